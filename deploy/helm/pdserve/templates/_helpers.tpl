{{/* The release's base name: the release name, or release-chart when the release name lacks the chart's. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* repository@digest when a digest is given (the tag is then ignored), else repository:tag. */}}
{{- define "pdserve.image" -}}
{{- $i := .Values.image -}}
{{- if $i.digest -}}
{{ $i.repository }}@{{ $i.digest }}
{{- else -}}
{{ $i.repository }}:{{ $i.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/*
A pod template's metadata: the chart's labels (they win: selectors, the Service and the budgets
depend on them) over the component's podLabels, and its podAnnotations.
args: dict "root" $ "component" <app.kubernetes.io/component> "pod" <the component's values> "extra" <more labels>.
*/}}
{{- define "pdserve.podMetadata" -}}
{{- $labels := include "pdserve.labels" .root | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/component" .component -}}
{{- $labels = merge $labels (.extra | default dict) (.pod.podLabels | default dict) -}}
labels:
  {{- toYaml $labels | nindent 2 }}
{{- with .pod.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The pod-level fields every pod of the release shares: pull secrets, scheduling, and the escape
hatches of the component's values. args: dict "root" $ "pod" <the component's values>.
*/}}
{{- define "pdserve.podSpecCommon" -}}
{{- $pod := .pod -}}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . }}
  {{- end }}
{{- end }}
{{- range $field := list "runtimeClassName" "serviceAccountName" "priorityClassName" }}
{{- with index $pod $field }}
{{ $field }}: {{ . }}
{{- end }}
{{- end }}
{{- with $pod.podSecurityContext }}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- range $field := list "nodeSelector" "tolerations" "affinity" "topologySpreadConstraints" "initContainers" }}
{{- with index $pod $field }}
{{ $field }}:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* KubeRay names the head's Service <cluster>-head-svc. */}}
{{- define "pdserve.headService" -}}
{{ include "pdserve.fullname" . }}-head-svc
{{- end -}}

{{- define "pdserve.routerName" -}}
{{ include "pdserve.fullname" . }}-router
{{- end -}}

{{/* The model as `pdserve serve --model` takes it; empty for the embedded default. */}}
{{- define "pdserve.modelArg" -}}
{{- $m := .Values.model -}}
{{- if or (eq $m.source "pvc") (eq $m.source "gguf") -}}
/models/{{ $m.path | trimPrefix "/" }}
{{- else if eq $m.source "hub" -}}
{{ $m.hubId }}
{{- end -}}
{{- end -}}

{{/* Env shared by the router and the Ray pods: the pod's own address, the model cache, the hub token. */}}
{{- define "pdserve.commonEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if .Values.model.cache.claimName }}
- name: PDSERVE_CACHE_DIR
  value: /var/cache/pdserve
- name: HF_HOME
  value: /var/cache/pdserve/hf
{{- end }}
{{- if and (eq .Values.model.source "hub") .Values.model.hubTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hubTokenSecret.name }}
      key: {{ .Values.model.hubTokenSecret.key }}
{{- end }}
{{- end -}}

{{- define "pdserve.modelMounts" -}}
{{- if .Values.model.claimName }}
- name: model
  mountPath: /models
  readOnly: true
{{- end }}
{{- if .Values.model.cache.claimName }}
- name: model-cache
  mountPath: /var/cache/pdserve
{{- end }}
{{- end -}}

{{- define "pdserve.modelVolumes" -}}
{{- if .Values.model.claimName }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.claimName }}
    readOnly: true
{{- end }}
{{- if .Values.model.cache.claimName }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ .Values.model.cache.claimName }}
{{- end }}
{{- end -}}

{{/* The UCX/NIXL environment of a pool pod: no transport pinned unless asked. */}}
{{- define "pdserve.kvEnv" -}}
{{- if .Values.kv.ucxTls }}
- name: UCX_TLS
  value: {{ .Values.kv.ucxTls | quote }}
{{- end }}
{{- if .Values.kv.ucxNetDevices }}
- name: UCX_NET_DEVICES
  value: {{ .Values.kv.ucxNetDevices | quote }}
{{- end }}
{{- with .Values.kv.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
GPUs of one pod of a pool: its `gpus`, or (null) its tensorParallelSize, one worker a pod. A pod
holds whole workers, each of tensorParallelSize GPUs (a worker's ranks share one node).
args: dict "root" $ "role" "prefill"|"decode".
*/}}
{{- define "pdserve.podGpus" -}}
{{- $pool := index .root.Values .role -}}
{{- $tp := int $pool.tensorParallelSize -}}
{{- $gpus := $tp -}}
{{- if not (kindIs "invalid" $pool.gpus) -}}
{{- $gpus = int $pool.gpus -}}
{{- end -}}
{{- if ne (mod $gpus $tp) 0 -}}
{{- fail (printf "%s.gpus: %d GPUs a pod do not hold whole workers of %s.tensorParallelSize %d GPUs; make gpus a multiple of %d (null: one worker a pod)" .role $gpus .role $tp $tp) -}}
{{- end -}}
{{- $gpus -}}
{{- end -}}

{{/* The pool's pdserve workers (`--prefill` / `--decode`): replicas x workers a pod. args: as pdserve.podGpus. */}}
{{- define "pdserve.poolWorkers" -}}
{{- $pool := index .root.Values .role -}}
{{- mul (int $pool.replicas) (div (int (include "pdserve.podGpus" .)) (int $pool.tensorParallelSize)) -}}
{{- end -}}

{{/* A worker group's pod template; args: dict "root" $ "role" "prefill"|"decode" "pool" .Values.<role>. */}}
{{- define "pdserve.poolTemplate" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
{{- $gpus := include "pdserve.podGpus" (dict "root" $root "role" .role) -}}
{{- /* The user's container securityContext, with IPC_LOCK added: NIXL/UCX pin the KV pool's memory for RDMA registration. */ -}}
{{- $sc := deepCopy ($pool.securityContext | default dict) -}}
{{- if $root.Values.kv.ipcLock -}}
{{- $caps := deepCopy (get $sc "capabilities" | default dict) -}}
{{- $_ := set $caps "add" (append (get $caps "add" | default list) "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end -}}
metadata:
  {{- include "pdserve.podMetadata" (dict "root" $root "component" .role "pod" $pool) | nindent 2 }}
spec:
  {{- with include "pdserve.podSpecCommon" (dict "root" $root "pod" $pool) | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  containers:
    - name: ray-worker
      image: {{ include "pdserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      env:
        {{- include "pdserve.commonEnv" $root | trim | nindent 8 }}
        {{- with include "pdserve.rayAuthEnv" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with include "pdserve.kvEnv" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $pool.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      resources:
        requests:
          cpu: {{ $pool.cpu | quote }}
          memory: {{ $pool.memory | quote }}
          {{ $root.Values.gpuResourceName }}: {{ $gpus | quote }}
          {{- if $root.Values.rdma.enabled }}
          {{ $root.Values.rdma.resourceName }}: {{ $root.Values.rdma.count | quote }}
          {{- end }}
        limits:
          cpu: {{ $pool.cpu | quote }}
          memory: {{ $pool.memory | quote }}
          {{ $root.Values.gpuResourceName }}: {{ $gpus | quote }}
          {{- if $root.Values.rdma.enabled }}
          {{ $root.Values.rdma.resourceName }}: {{ $root.Values.rdma.count | quote }}
          {{- end }}
      {{- with $sc }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- with include "pdserve.modelMounts" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $pool.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.shm.size }}
    {{- with include "pdserve.modelVolumes" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $pool.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
