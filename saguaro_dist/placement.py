"""Ray placement options shared by the runtime and the Kubernetes manifests.

The target's tensor-parallel ranks and the draft workers ask Ray for these custom resources; the
KubeRay worker groups advertise them (deploy/ and saguaro_dist.deploy read the same names), so the
target lands on target nodes and the drafts on draft nodes. A cluster without them (a laptop, CI)
falls back to plain CPU/GPU placement.
"""
TARGET_RESOURCE = "saguaro_target"
DRAFT_RESOURCE = "saguaro_draft"
RESOURCE_PER_ACTOR = 1
