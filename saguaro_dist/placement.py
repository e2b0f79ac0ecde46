"""Ray placement options shared by the runtime and the Kubernetes manifests.

The target's tensor-parallel ranks and the draft workers ask Ray for these custom resources; the
KubeRay worker groups advertise them (deploy/ and saguaro_dist.deploy read the same names), so the
target lands on target nodes and the drafts on draft nodes. A cluster without them (a laptop, CI)
falls back to plain CPU/GPU placement.

FRONT_RESOURCE: the target pod also advertises one slot for the Serve replica (the app's front), which owns the
engine's actors: a KubeRay serveConfigV2 asks for it (saguaro_dist/deploy/serve_app.py), so the replica never
lands on a draft pod, whose loss would then take the target's ranks with it. `saguaro serve` on plain Ray never
asks for it.
"""
TARGET_RESOURCE = "saguaro_target"
DRAFT_RESOURCE = "saguaro_draft"
FRONT_RESOURCE = "saguaro_front"
RESOURCE_PER_ACTOR = 1
