{{/* Names and labels. Keep in step with saguaro_dist/deploy/ (k8s.py and the modules beside it): tests compare the two. */}}
{{- define "saguaro.fullname" -}}
{{- /* refused, not truncated, past 40 characters: as `saguaro deploy k8s --name` (KubeRay derives longer names) */ -}}
{{- $name := default .Release.Name .Values.fullnameOverride -}}
{{- if or (gt (len $name) 40) (not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $name)) -}}
{{- fail (printf "name %q (the release name, or fullnameOverride) must be a DNS-1035 label of 1-40 characters: lowercase letters, digits or '-', starting with a letter and ending with a letter or digit (it names the Services, and KubeRay derives longer names from it; Helm allows release names Kubernetes refuses there)" $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/* The image: image.tag, or the one deploy/Dockerfile.cuda (GPUs) or deploy/Dockerfile.cpu builds. */}}
{{- define "saguaro.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion (ternary "cuda" "cpu" (eq (include "saguaro.gpu" .) "true"))) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* Ray's CPUs from a Kubernetes CPU quantity ("4", "2.5", "500m"): KubeRay's num-cpus, Quantity.Value(), which
     rounds a fraction up (saguaro_dist/deploy/settings.py cpu_quantity). */}}
{{- define "saguaro.rayCpus" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q }}{{ divf (trimSuffix "m" $q | float64) 1000 | ceil | int }}{{ else }}{{ $q | float64 | ceil | int }}{{ end -}}
{{- end -}}

{{/* image.pullPolicy, or Kubernetes' default for the image: Always for the tag latest, else IfNotPresent; the tag is
     read before any @digest, as Kubernetes does (saguaro_dist/deploy/settings.py pull_policy). */}}
{{- define "saguaro.pullPolicy" -}}
{{- $name := regexReplaceAll "@.*$" (include "saguaro.image" .) "" -}}
{{- .Values.image.pullPolicy | default (ternary "Always" "IfNotPresent" (hasSuffix ":latest" $name)) -}}
{{- end -}}

{{/* Pod selector labels; not app.kubernetes.io/name, which KubeRay sets on its pods. */}}
{{- define "saguaro.selectorLabels" -}}
app.kubernetes.io/part-of: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ include "saguaro.fullname" . }}
{{- end -}}

{{- define "saguaro.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
{{ include "saguaro.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "saguaro.gpu" -}}
{{- if or .Values.gpu.enabled .Values.gpu.type }}true{{ end -}}
{{- end -}}

{{- define "saguaro.dtype" -}}
{{- .Values.engine.dtype | default (ternary "bfloat16" "float32" (eq (include "saguaro.gpu" .) "true")) -}}
{{- end -}}

{{/* The autoscaling values, refused where they would promise pods: the engine starts draft.workers draft workers
     (num_draft_workers) and one target pod's ranks, and never asks Ray for more, so Ray's in-tree autoscaler would
     add no pod (it adds one only for resources that work asks for and no node has). Kept so values files that
     leave them off still lint; idleTimeoutSeconds timed the removal of idle added pods, and none is ever added. */}}
{{- define "saguaro.checkAutoscaling" -}}
{{- $a := .Values.autoscaling | default dict -}}
{{- $workers := int .Values.draft.workers -}}
{{- $why := printf "the engine runs a fixed pool: draft.workers (%d) draft workers, started once, and one target pod; it never asks Ray for more, so Ray's autoscaler would add no pod. Set draft.workers to the draft pool you want (docs/deploy.md, \"Scale the draft pool\")" $workers -}}
{{- if $a.enabled }}{{ fail (printf "autoscaling.enabled is not supported: %s" $why) }}{{ end -}}
{{- $max := int ($a.draftMaxWorkers | default 0) -}}
{{- if and $max (ne $max $workers) }}{{ fail (printf "autoscaling.draftMaxWorkers %d is not supported: %s" $max $why) }}{{ end -}}
{{- if hasKey $a "idleTimeoutSeconds" }}{{ fail (printf "autoscaling.idleTimeoutSeconds is not supported (no pod is ever added, so none idles): %s" $why) }}{{ end -}}
{{- end -}}

{{/* rayStartParams `resources` from a dict of them: KubeRay passes it to `ray start` through a shell, hence the
     quoting (keys sorted, as saguaro_dist/deploy/pods.py ray_resources_param). */}}
{{- define "saguaro.rayResources" -}}
{{- . | toJson | toJson | squote -}}
{{- end -}}

{{/* What the values speculate with: speculation.mode / k / promptLookupMax / promptLookupMin and model.draft /
     draftRevision, with what speculation.speculativeConfig (vLLM's) sets in their place, as
     saguaro_dist/speculative_config.py maps it (K8sSettings._apply_speculative_config). mode, k and draft are
     null unless given, so that one given beside the config, even at its default, must agree with it (as
     `saguaro serve` and K8sSettings refuse it otherwise). JSON, for fromJson. */}}
{{- define "saguaro.speculation" -}}
{{- $v := .Values -}}
{{- $s := $v.speculation -}}
{{- $given := dict -}}
{{- range $field, $value := dict "mode" $s.mode "k" $s.k "draft" $v.model.draft "promptLookupMax" $s.promptLookupMax "promptLookupMin" $s.promptLookupMin -}}
{{- if not (kindIs "invalid" $value) }}{{ $_ := set $given $field $value }}{{ end -}}
{{- end -}}
{{- if $v.model.draftRevision }}{{ $_ := set $given "draftRevision" $v.model.draftRevision }}{{ end -}}
{{- /* null: K8sSettings' defaults */ -}}
{{- /* model.draft "" (none) with no mode and no speculativeConfig: ar, as `saguaro deploy k8s --draft ""` */ -}}
{{- $noDraft := and (kindIs "string" $v.model.draft) (eq $v.model.draft "") -}}
{{- $mode := $s.mode | default (ternary "ar" "ssd" (and $noDraft (kindIs "invalid" $s.speculativeConfig))) -}}
{{- $out := dict "mode" $mode "k" ($s.k | default 4) "draftRevision" $v.model.draftRevision -}}
{{- $_ := set $out "draft" (ternary "Qwen/Qwen3-0.6B" $v.model.draft (kindIs "invalid" $v.model.draft)) -}}
{{- $_ := set $out "promptLookupMax" $s.promptLookupMax -}}
{{- $_ := set $out "promptLookupMin" $s.promptLookupMin -}}
{{- with $s.speculativeConfig -}}
{{- include "saguaro.speculativeConfigFields" (dict "spec" . "given" $given "out" $out) -}}
{{- end -}}
{{- if and (has $out.mode (list "sd" "ssd")) (not $out.draft) -}}
{{- fail (printf "speculation.mode %s needs a draft model, but model.draft is \"\" (none): give model.draft, or speculation.mode ar or ngram (speculation.mode null beside model.draft \"\": ar)" $out.mode) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* speculativeConfig's fields set on .out (speculative_config.config_fields' rules). Arguments: spec, given
     (the values given beside it), out. */}}
{{- define "saguaro.speculativeConfigFields" -}}
{{- $spec := .spec -}}
{{- $method := get $spec "method" | default "" -}}
{{- $ngram := or (eq $method "ngram") (and (not $method) (has (get $spec "model") (list "ngram" "[ngram]"))) -}}
{{- $mode := get .given "mode" -}}
{{- if $ngram -}}
{{- if and (hasKey .given "mode") (ne $mode "ngram") }}{{ fail (printf "speculation.speculativeConfig method ngram runs speculation.mode ngram, but speculation.mode is %s" $mode) }}{{ end -}}
{{- if hasKey .given "draft" }}{{ fail (printf "speculation.speculativeConfig method ngram takes no draft model, but model.draft is %q: drop one (leave model.draft null)" .given.draft) }}{{ end -}}
{{- $_ := set .out "mode" "ngram" -}}
{{- else -}}
{{- if and (hasKey .given "mode") (not (has $mode (list "sd" "ssd"))) }}{{ fail (printf "speculation.speculativeConfig with a draft model runs speculation.mode sd or ssd, but speculation.mode is %s" $mode) }}{{ end -}}
{{- if get $spec "model" -}}
{{- include "saguaro.speculativeTake" (dict "ctx" . "key" "model" "field" "draft" "name" "model.draft") -}}
{{- else if not (hasKey .given "draft") -}}
{{- fail "speculation.speculativeConfig needs model (the draft's folder or Hugging Face id) or method ngram, or model.draft given" -}}
{{- end -}}
{{- if get $spec "revision" }}{{ include "saguaro.speculativeTake" (dict "ctx" . "key" "revision" "field" "draftRevision" "name" "model.draftRevision") }}{{ end -}}
{{- end -}}
{{- range $key, $field := dict "num_speculative_tokens" "k" "prompt_lookup_max" "promptLookupMax" "prompt_lookup_min" "promptLookupMin" -}}
{{- if get $spec $key }}{{ include "saguaro.speculativeTake" (dict "ctx" $ "key" $key "field" $field "name" (printf "speculation.%s" $field)) }}{{ end -}}
{{- end -}}
{{- /* one lookup size given alone stands for both, as in vLLM (unless the values give the other) */ -}}
{{- $max := get $spec "prompt_lookup_max" -}}
{{- $min := get $spec "prompt_lookup_min" -}}
{{- if and $min (not $max) (not (hasKey .given "promptLookupMax")) }}{{ $_ := set .out "promptLookupMax" $min }}{{ end -}}
{{- if and $max (not $min) (not (hasKey .given "promptLookupMin")) }}{{ $_ := set .out "promptLookupMin" $max }}{{ end -}}
{{- end -}}

{{/* .ctx.out's field = speculativeConfig's key, unless the values give that field another value: one setting,
     said twice. Arguments: ctx (spec, given, out), key, field, name (the value's path, for the message). */}}
{{- define "saguaro.speculativeTake" -}}
{{- $value := get .ctx.spec .key -}}
{{- if and (hasKey .ctx.given .field) (ne (toString (get .ctx.given .field)) (toString $value)) -}}
{{- fail (printf "speculation.speculativeConfig %s=%v conflicts with %s=%v: give it once" .key $value .name (get .ctx.given .field)) -}}
{{- end -}}
{{- $_ := set .ctx.out .field $value -}}
{{- end -}}

{{/* Whether the speculation runs a draft model (draft pods, draft args): modes sd and ssd. */}}
{{- define "saguaro.usesDraft" -}}
{{- if has (include "saguaro.speculation" . | fromJson).mode (list "sd" "ssd") }}true{{ end -}}
{{- end -}}

{{/* The Serve config (ray.serve.schema.ServeDeploySchema); args parse with saguaro_dist.serve.args. */}}
{{- define "saguaro.serveConfig" -}}
{{- $spec := include "saguaro.speculation" . | fromJson -}}
{{- $args := dict "model" .Values.model.target "mode" $spec.mode "k" (int $spec.k) -}}
{{- $usesDraft := has $spec.mode (list "sd" "ssd") -}}
{{- if and $usesDraft $spec.draft }}{{ $_ := set $args "draft" $spec.draft }}{{ end -}}
{{- $_ := set $args "cluster" "auto" -}}
{{- $_ := set $args "fan_out" .Values.speculation.fanOut -}}
{{- $_ := set $args "saguaro_c" .Values.speculation.saguaroC -}}
{{- $_ := set $args "fallback" .Values.speculation.fallback -}}
{{- $_ := set $args "tensor_parallel_size" (int .Values.target.tensorParallelSize) -}}
{{- $_ := set $args "num_draft_workers" (int .Values.draft.workers) -}}
{{- $_ := set $args "max_batch_size" (int .Values.engine.maxBatchSize) -}}
{{- if .Values.engine.maxModelLen }}{{ $_ := set $args "max_model_len" (int .Values.engine.maxModelLen) }}{{ end -}}
{{- $_ := set $args "gpu_memory_utilization" (float64 .Values.engine.gpuMemoryUtilization) -}}
{{- $_ := set $args "device" (ternary "cuda" "cpu" (eq (include "saguaro.gpu" .) "true")) -}}
{{- $_ := set $args "dtype" (include "saguaro.dtype" .) -}}
{{- $_ := set $args "api_key_env" "SAGUARO_API_KEY" -}}
{{- if .Values.model.revision }}{{ $_ := set $args "revision" .Values.model.revision }}{{ end -}}
{{- if and $usesDraft $spec.draftRevision }}{{ $_ := set $args "draft_revision" $spec.draftRevision }}{{ end -}}
{{- if .Values.model.tokenizer }}{{ $_ := set $args "tokenizer" .Values.model.tokenizer }}{{ end -}}
{{- if .Values.model.tokenizerRevision }}{{ $_ := set $args "tokenizer_revision" .Values.model.tokenizerRevision }}{{ end -}}
{{- if .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" .Values.model.servedModelName }}{{ end -}}
{{- if .Values.model.toolCallParser }}{{ $_ := set $args "tool_call_parser" .Values.model.toolCallParser }}{{ end -}}
{{- if .Values.model.reasoningParser }}{{ $_ := set $args "reasoning_parser" .Values.model.reasoningParser }}{{ end -}}
{{- if ne (.Values.model.generationConfig | default "auto") "auto" }}{{ $_ := set $args "generation_config" .Values.model.generationConfig }}{{ end -}}
{{- if .Values.model.chatTemplate }}{{ $_ := set $args "chat_template" .Values.model.chatTemplate }}{{ end -}}
{{- if eq (.Values.engine.schedulingPolicy | default "fcfs") "priority" }}{{ $_ := set $args "scheduling_policy" "priority" }}{{ end -}}
{{- include "saguaro.serveFlagArgs" (dict "args" $args "engine" .Values.engine "server" (.Values.server | default dict)) -}}
{{- include "saguaro.speculationArgs" (dict "args" $args "speculation" .Values.speculation "resolved" $spec) -}}
{{- include "saguaro.frontendArgs" (dict "args" $args "server" (.Values.server | default dict)) -}}
{{- include "saguaro.loraArgs" (dict "args" $args "lora" (.Values.lora | default dict)) -}}
{{- /* the replica on the target pod's saguaro_front slot: it owns the ranks (saguaro_dist/deploy/serve_app.py replica_actor_options) */ -}}
{{- $replica := dict "name" "SaguaroServer" "ray_actor_options" (dict "num_cpus" 1 "resources" (dict "saguaro_front" 1)) -}}
{{- $app := dict "name" "saguaro" "route_prefix" "/" "import_path" "saguaro_dist.serve.app:build_app" "args" $args "deployments" (list $replica) -}}
{{- $config := dict "proxy_location" "EveryNode" "http_options" (dict "host" "0.0.0.0" "port" 8000) "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}

{{/* vLLM's LoRA flags as app args, where the values leave the app's default (as saguaro_dist/deploy/serve_app.py
     _serve_flag_args). Arguments: args, lora (values). */}}
{{- define "saguaro.loraArgs" -}}
{{- $l := .lora -}}
{{- if $l.enable }}{{ $_ := set .args "enable_lora" true }}{{ end -}}
{{- if not (kindIs "invalid" $l.maxLoras) }}{{ $_ := set .args "max_loras" (int $l.maxLoras) }}{{ end -}}
{{- if not (kindIs "invalid" $l.maxLoraRank) }}{{ $_ := set .args "max_lora_rank" (int $l.maxLoraRank) }}{{ end -}}
{{- if not (kindIs "invalid" $l.maxCpuLoras) }}{{ $_ := set .args "max_cpu_loras" (int $l.maxCpuLoras) }}{{ end -}}
{{- if $l.modules }}{{ $_ := set .args "lora_modules" $l.modules }}{{ end -}}
{{- end -}}

{{/* `saguaro serve`'s engine and server flags as app args, set on .args only where the values leave the app's
     default (as saguaro_dist/deploy/serve_app.py _serve_flag_args). Arguments: args, engine, server (values). */}}
{{- define "saguaro.serveFlagArgs" -}}
{{- $e := .engine -}}
{{- $s := .server -}}
{{- if $e.maxNumBatchedTokens }}{{ $_ := set .args "max_num_batched_tokens" (int $e.maxNumBatchedTokens) }}{{ end -}}
{{- if and (kindIs "bool" $e.enablePrefixCaching) (not $e.enablePrefixCaching) }}{{ $_ := set .args "enable_prefix_caching" false }}{{ end -}}
{{- if $e.enforceEager }}{{ $_ := set .args "enforce_eager" true }}{{ end -}}
{{- if $e.disableLogStats }}{{ $_ := set .args "log_stats_interval_s" 0.0 }}{{ end -}}
{{- if not (kindIs "invalid" $e.seed) }}{{ $_ := set .args "seed" (int64 $e.seed) }}{{ end -}}
{{- if $s.maxRequestBytes }}{{ $_ := set .args "max_request_bytes" (int $s.maxRequestBytes) }}{{ end -}}
{{- if not (kindIs "invalid" $s.streamIntervalMs) }}{{ $_ := set .args "stream_interval_ms" (float64 $s.streamIntervalMs) }}{{ end -}}
{{- if $s.enableLogRequests }}{{ $_ := set .args "log_requests" true }}{{ end -}}
{{- if $s.otlpTracesEndpoint }}{{ $_ := set .args "otlp_traces_endpoint" $s.otlpTracesEndpoint }}{{ end -}}
{{- if $s.collectDetailedTraces }}
{{- if not $s.otlpTracesEndpoint }}{{ fail "server.collectDetailedTraces requires server.otlpTracesEndpoint to be set (vLLM's --collect-detailed-traces needs --otlp-traces-endpoint)" }}{{ end -}}
{{- $_ := set .args "collect_detailed_traces" $s.collectDetailedTraces }}
{{- end -}}
{{- end -}}

{{/* --proposal-top-k, --prompt-lookup-max / -min and --speculative-config as app args, where given (as
     saguaro_dist/deploy/serve_app.py _speculation_args). Arguments: args, speculation (values), resolved
     (saguaro.speculation's). */}}
{{- define "saguaro.speculationArgs" -}}
{{- if .speculation.proposalTopK }}{{ $_ := set .args "proposal_top_k" (int .speculation.proposalTopK) }}{{ end -}}
{{- if not (kindIs "invalid" .resolved.promptLookupMax) }}{{ $_ := set .args "prompt_lookup_max" (int .resolved.promptLookupMax) }}{{ end -}}
{{- if not (kindIs "invalid" .resolved.promptLookupMin) }}{{ $_ := set .args "prompt_lookup_min" (int .resolved.promptLookupMin) }}{{ end -}}
{{- if not (kindIs "invalid" .speculation.speculativeConfig) }}{{ $_ := set .args "speculative_config" .speculation.speculativeConfig }}{{ end -}}
{{- end -}}

{{/* `saguaro serve`'s HTTP-frontend flags (vLLM's CORS, --root-path, --disable-fastapi-docs) as app args, where
     they leave the app's default (as saguaro_dist/deploy/serve_app.py _frontend_args). Arguments: args, server. */}}
{{- define "saguaro.frontendArgs" -}}
{{- $s := .server -}}
{{- if not (kindIs "invalid" $s.allowedOrigins) }}{{ $_ := set .args "allowed_origins" $s.allowedOrigins }}{{ end -}}
{{- if not (kindIs "invalid" $s.allowedMethods) }}{{ $_ := set .args "allowed_methods" $s.allowedMethods }}{{ end -}}
{{- if not (kindIs "invalid" $s.allowedHeaders) }}{{ $_ := set .args "allowed_headers" $s.allowedHeaders }}{{ end -}}
{{- if $s.allowCredentials }}{{ $_ := set .args "allow_credentials" true }}{{ end -}}
{{- if $s.rootPath }}{{ $_ := set .args "root_path" $s.rootPath }}{{ end -}}
{{- if $s.disableFastapiDocs }}{{ $_ := set .args "disable_fastapi_docs" true }}{{ end -}}
{{- if $s.responseRole }}{{ $_ := set .args "response_role" $s.responseRole }}{{ end -}}
{{- end -}}

{{/* KubeRay's own probes, written out (a probe given here replaces KubeRay's whole): the raylet's health,
     the GCS's on the head, and on a RayService's workers (serving) the Serve proxy's, which takes a pod out of
     the Serve Service at its first failure (Serve runs proxies only where replicas run). Arguments as
     saguaro.container. Keep in step with saguaro_dist/deploy/pods.py _probes. */}}
{{- define "saguaro.probes" -}}
{{- $health := "wget -T 2 -q -O- http://localhost:52365/api/local_raylet_healthz | grep success" -}}
{{- if .head }}{{ $health = printf "%s && wget -T 2 -q -O- http://localhost:8265/api/gcs_healthz | grep success" $health }}{{ end -}}
{{- $ready := $health -}}
{{- if .serving }}{{ $ready = printf "%s && wget -T 2 -q -O- http://localhost:8000/-/healthz | grep success" $health }}{{ end -}}
{{- $timeout := ternary 5 2 (.head | default false) }}
readinessProbe:
  exec:
    command: ["bash", "-c", {{ $ready | quote }}]
  initialDelaySeconds: 10
  periodSeconds: 5
  timeoutSeconds: {{ $timeout }}
  failureThreshold: {{ ternary 1 10 (.serving | default false) }}
livenessProbe:
  exec:
    command: ["bash", "-c", {{ $health | quote }}]
  initialDelaySeconds: 30
  periodSeconds: 5
  timeoutSeconds: {{ $timeout }}
  failureThreshold: 120
{{- end -}}

{{/* One Ray container. Arguments: root, cpu, memory, gpus, head, serving (a RayService's worker). */}}
{{- define "saguaro.container" -}}
{{- $v := .root.Values -}}
name: {{ ternary "ray-head" "ray-worker" .head }}
image: {{ include "saguaro.image" .root | quote }}
imagePullPolicy: {{ include "saguaro.pullPolicy" .root }}
env:
  - name: SAGUARO_API_KEY
    valueFrom:
      secretKeyRef: {name: {{ $v.apiKey.secretName | quote }}, key: {{ $v.apiKey.secretKey | quote }}}
  {{- if $v.hfToken.secretName }}
  - name: HF_TOKEN
    valueFrom:
      secretKeyRef: {name: {{ $v.hfToken.secretName | quote }}, key: {{ $v.hfToken.secretKey | quote }}, optional: true}
  {{- end }}
  - name: HF_HOME
    value: /models/hf-cache
  - name: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
    value: {{ int $v.termination.drainTimeoutSeconds | toString | quote }}
  {{- range $name, $value := $v.extraEnv }}
  - name: {{ $name | quote }}
    value: {{ $value | quote }}
  {{- end }}
ports:
  {{- if .head }}
  - {name: gcs-server, containerPort: 6379}
  - {name: dashboard, containerPort: 8265}
  - {name: client, containerPort: 10001}
  - {name: serve, containerPort: 8000}
  {{- end }}
  - {name: metrics, containerPort: 8080}
{{- $amounts := dict "cpu" (toString .cpu) "memory" (toString .memory) }}
{{- if .gpus }}{{ $_ := set $amounts "nvidia.com/gpu" (int .gpus) }}{{ end }}
resources:
  requests: {{- toYaml $amounts | nindent 4 }}
  limits: {{- toYaml $amounts | nindent 4 }}
securityContext: {runAsNonRoot: true, runAsUser: 1000, allowPrivilegeEscalation: false}
volumeMounts:
  - {name: models, mountPath: /models}
  - {name: dshm, mountPath: /dev/shm}
{{ include "saguaro.probes" . }}
{{- end -}}

{{/* A pod template. Arguments as saguaro.container. */}}
{{- define "saguaro.podTemplate" -}}
{{- $v := .root.Values -}}
metadata:
  labels: {{- include "saguaro.selectorLabels" .root | nindent 4 }}
  {{- with .annotations }}
  annotations: {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  containers:
    - {{ include "saguaro.container" . | nindent 6 | trim }}
  volumes:
    {{- if $v.modelStorage.pvc }}
    - {name: models, persistentVolumeClaim: {claimName: {{ $v.modelStorage.pvc | quote }}}}
    {{- else }}
    - {name: models, emptyDir: {}}
    {{- end }}
    - {name: dshm, emptyDir: {medium: Memory}}
  securityContext: {fsGroup: 1000}
  {{- /* longer than Ray's drain window on SIGTERM, or Kubernetes kills the pod while Serve drains it */}}
  terminationGracePeriodSeconds: {{ add (int $v.termination.drainTimeoutSeconds) 15 }}
  {{- with $v.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - {name: {{ . | quote }}}
    {{- end }}
  {{- end }}
  {{- if and .gpus $v.gpu.type }}
  nodeSelector:
    nvidia.com/gpu.product: {{ $v.gpu.type | quote }}
  {{- end }}
  {{- if .gpus }}
  tolerations:
    - {key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}
  {{- end }}
{{- end -}}

{{/* A worker group. Arguments: root, name, resources (a dict), annotations (the pod template's), gpus, cpu, memory,
     replicas, maxReplicas, serving. */}}
{{- define "saguaro.workerGroup" -}}
groupName: {{ .name }}
replicas: {{ .replicas }}
minReplicas: {{ .replicas }}
maxReplicas: {{ .maxReplicas }}
rayStartParams:
  resources: {{ include "saguaro.rayResources" .resources }}
  metrics-export-port: "8080"
template: {{- include "saguaro.podTemplate" (merge (dict "head" false) .) | nindent 2 }}
{{- end -}}

{{/* KubeRay's gcsFaultToleranceOptions, for a RayService's cluster; nothing while redisAddress is "".
     Keep in step with saguaro_dist/deploy/cluster.py gcs_fault_tolerance. */}}
{{- define "saguaro.gcsFaultTolerance" -}}
{{- $password := .redisPassword | default dict -}}
{{- if and $password.secretName (not .redisAddress) -}}
{{- fail "gcsFaultTolerance.redisPassword.secretName needs gcsFaultTolerance.redisAddress (the Redis it is the password of)" -}}
{{- end -}}
{{- if .redisAddress }}
gcsFaultToleranceOptions:
  redisAddress: {{ .redisAddress | quote }}
  {{- if $password.secretName }}
  redisPassword:
    valueFrom:
      secretKeyRef: {name: {{ $password.secretName | quote }}, key: {{ $password.secretKey | default "password" | quote }}}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The Ray cluster: a head that runs no work, the target group, the draft group (modes with a draft).
     Arguments: root, serving (true: a RayService's cluster). */}}
{{- define "saguaro.rayClusterSpec" -}}
{{- $root := .root -}}
{{- $serving := .serving -}}
{{- $v := $root.Values -}}
{{- $gpu := eq (include "saguaro.gpu" $root) "true" -}}
{{- $tp := int $v.target.tensorParallelSize -}}
{{- $drafts := int $v.draft.workers -}}
{{- /* Ray's CPUs must hold what placement asks (saguaro_dist.deploy.settings.K8sSettings._check_cpus): on CPUs a CPU
       per rank, all on the target pod, plus the Serve replica's (it asks for the target pod's saguaro_front); one
       per draft pod. */ -}}
{{- $targetNeeds := ternary 1 (add1 $tp) $gpu -}}
{{- $targetCpus := int (include "saguaro.rayCpus" $v.target.resources.cpu) -}}
{{- if lt $targetCpus (int $targetNeeds) -}}
{{- fail (printf "target.resources.cpu %v gives Ray %d CPU(s) on the target pod; it needs %d: %s" $v.target.resources.cpu $targetCpus (int $targetNeeds) (ternary "the Serve replica's" (printf "one per tensor-parallel rank (%d, packed on that pod) and one for the Serve replica" $tp) $gpu)) -}}
{{- end -}}
{{- $usesDraft := eq (include "saguaro.usesDraft" $root) "true" -}}
{{- if and (not $gpu) $usesDraft (lt (int (include "saguaro.rayCpus" $v.draft.resources.cpu)) 1) -}}
{{- fail (printf "draft.resources.cpu %v gives Ray no CPU on a draft pod; it needs 1: the draft worker's" $v.draft.resources.cpu) -}}
{{- end -}}
{{- include "saguaro.checkAutoscaling" $root -}}
rayVersion: "2.60.0"
enableInTreeAutoscaling: false
{{- if $serving }}{{ include "saguaro.gcsFaultTolerance" $v.gcsFaultTolerance }}{{ end }}
headGroupSpec:
  rayStartParams:
    num-cpus: "0"
    dashboard-host: 0.0.0.0
    metrics-export-port: "8080"
  template: {{- include "saguaro.podTemplate" (dict "root" $root "cpu" $v.head.resources.cpu "memory" $v.head.resources.memory "gpus" 0 "head" true "serving" false) | nindent 4 }}
workerGroupSpecs:
  {{- /* the pools' sizes as annotations too: KubeRay hashes the cluster spec without the groups' replicas, so a
         new draft.workers (or tp) rolls out a new cluster only through a field it hashes (kuberay#2333) */}}
  - {{ include "saguaro.workerGroup" (dict "root" $root "name" "target" "resources" (dict "saguaro_target" $tp "saguaro_front" 1) "annotations" (dict "saguaro-dist/tp" (toString $tp)) "gpus" (ternary $tp 0 $gpu) "cpu" $v.target.resources.cpu "memory" $v.target.resources.memory "replicas" 1 "maxReplicas" 1 "serving" $serving) | nindent 4 | trim }}
{{- if $usesDraft }}
  - {{ include "saguaro.workerGroup" (dict "root" $root "name" "draft" "resources" (dict "saguaro_draft" 1) "annotations" (dict "saguaro-dist/draft-workers" (toString $drafts)) "gpus" (ternary 1 0 $gpu) "cpu" $v.draft.resources.cpu "memory" $v.draft.resources.memory "replicas" $drafts "maxReplicas" $drafts "serving" $serving) | nindent 4 | trim }}
{{- end }}
{{- end -}}
