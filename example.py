"""saguaro-dist in a few lines: SSD generation on the shipped demo pair, on an embedded local Ray cluster.

    python example.py            # the README's first Quickstart command runs this
"""
import logging

from saguaro_dist import LLM, SamplingParams, StructuredOutputsParams
from saguaro_dist.demo import demo_pair, demo_prompts


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    target, draft = demo_pair()
    # Target (rank 0 runs the round loop) and one draft worker, each its own Ray actor with one torch thread;
    # the draft prepares the next speculation for the likely outcomes while the target verifies.
    with LLM(model=target, draft=draft, mode="ssd", k=4, fan_out=12, cluster="local",
             target_threads=1, draft_threads=1) as llm:
        prompts = demo_prompts(2)
        # Sampled, seeded: greedy decoding of a pair this small falls into loops of comment lines ("#\n").
        # The output distribution is exactly the target's whichever path (cache hit or fallback) ran.
        outputs = llm.generate(prompts, SamplingParams(temperature=0.7, top_p=0.95, max_tokens=96, seed=0))
        for prompt, out in zip(prompts, outputs):
            m = out.metrics  # (out.text, out.token_ids, ...: its sample 0's, out.outputs[0], as vLLM's)
            print(f"--- prompt (last 160 chars) ---\n{prompt[-160:]}\n--- continuation ---\n{out.outputs[0].text}")
            print(f"[{m.num_generated_tokens} tokens, {m.tokens_per_s:.1f} tok/s, acceptance {m.acceptance_rate:.2f}, "
                  f"mean accepted length {m.mean_accepted_length:.2f}, cache hit rate {m.cache_hit_rate:.2f}, "
                  f"fallbacks {m.fallbacks}]\n")
        # vLLM's n: samples of one prompt in out.outputs, in index order (sample i draws from seed + i).
        samples = llm.generate(prompts[:1], SamplingParams(temperature=0.7, top_p=0.95, max_tokens=24, seed=0, n=2))[0]
        print(f"two samples: {[c.text for c in samples.outputs]}\n")
        # Structured outputs: the target's distribution masked to a JSON schema on every path (the draft is
        # told the schema too, so its proposals fit it); any of regex=, choice=[...], grammar= works the same.
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"}},
                  "required": ["name", "size"], "additionalProperties": False}
        answer = llm.generate(["x = "], SamplingParams(temperature=0, max_tokens=48,
                                                       structured_outputs=StructuredOutputsParams(json=schema)))[0]
        print(f"JSON under a schema: {answer.text}\n")
        e = llm.metrics  # the cache hit rate counts rounds that looked a tree up; the tree gate may skip trees
        print(f"engine: {e.rounds} rounds; without a speculation tree, where the gate measured that faster: "
              f"{e.just_in_time_rounds} drafted just in time, {e.fast_rounds} on n-gram proposals alone; "
              f"{e.cache_hits} cache hits, {e.cache_misses} misses, {e.lookup_rows} rows that took their n-gram "
              f"proposal over the draft's")
        if e.tree_builds:  # SSD hides the draft entirely while a tree takes no longer than a verify (Theorem 7)
            print(f"per round: the target verified in {1e3 * e.verify_s / e.rounds:.1f} ms, "
                  f"the draft built a tree in {1e3 * e.tree_build_s / e.tree_builds:.1f} ms")


if __name__ == "__main__":
    main()
