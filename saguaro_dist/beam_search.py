"""vLLM's vllm.beam_search names (and vllm.sampling_params' BeamSearchParams), where code written for vLLM
imports them: the search itself is engine/beam_search.py, LLM.beam_search its entry point."""
from saguaro_dist.engine.beam_search import (BeamSearchInstance, BeamSearchOutput, BeamSearchParams,
                                             BeamSearchSequence, create_sort_beams_key_function, get_beam_search_score)

__all__ = ["BeamSearchInstance", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence",
           "create_sort_beams_key_function", "get_beam_search_score"]
