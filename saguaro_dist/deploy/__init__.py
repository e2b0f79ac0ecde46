"""Deployment: KubeRay manifests (`k8s`, behind `saguaro deploy k8s`, built from `settings`, `serve_app`, `pods`,
`cluster` and `helm` beside it), their offline validators
(`validation`) and the images' health check (`healthcheck`). The Helm chart, the Dockerfiles and the
cluster-launcher config live in deploy/ at the repository root; docs/deploy.md walks through them."""
