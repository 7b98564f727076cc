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

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
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

{{/* A worker group's pod template; args: dict "root" $ "role" "prefill"|"decode" "pool" .Values.<role>. */}}
{{- define "pdserve.poolTemplate" -}}
{{- $root := .root -}}
{{- $pool := .pool -}}
metadata:
  labels:
    {{- include "pdserve.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .role }}
spec:
  {{- with $root.Values.image.pullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  {{- with $pool.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pool.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $pool.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
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
      resources:
        requests:
          cpu: {{ $pool.cpu | quote }}
          memory: {{ $pool.memory | quote }}
          {{ $root.Values.gpuResourceName }}: {{ $pool.gpus | quote }}
          {{- if $root.Values.rdma.enabled }}
          {{ $root.Values.rdma.resourceName }}: {{ $root.Values.rdma.count | quote }}
          {{- end }}
        limits:
          cpu: {{ $pool.cpu | quote }}
          memory: {{ $pool.memory | quote }}
          {{ $root.Values.gpuResourceName }}: {{ $pool.gpus | quote }}
          {{- if $root.Values.rdma.enabled }}
          {{ $root.Values.rdma.resourceName }}: {{ $root.Values.rdma.count | quote }}
          {{- end }}
      securityContext:
        capabilities:
          # NIXL/UCX pin the KV pool's memory for RDMA registration.
          add: ["IPC_LOCK"]
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- with include "pdserve.modelMounts" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
  volumes:
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $root.Values.shm.size }}
    {{- with include "pdserve.modelVolumes" $root | trim }}
    {{- . | nindent 4 }}
    {{- end }}
{{- end -}}
