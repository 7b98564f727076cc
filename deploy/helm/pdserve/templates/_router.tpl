{{- /*
What every router pod shares, the first (`pdserve serve`, router-deployment.yaml) and the ones that
join it (`pdserve router`, router-replicas.yaml): edge flags, probes, volumes and the pod itself.
*/ -}}

{{/* The label every router pod carries and the Service, NetworkPolicy and PDB select. */}}
{{- define "pdserve.routerEdgeLabels" -}}
{{ include "pdserve.selectorLabels" . }}
pdserve.io/edge: router
{{- end -}}

{{/* Ray's token authentication in a pod, from rayAuth's Secret (never a literal). */}}
{{- define "pdserve.rayAuthEnv" -}}
{{- if .Values.rayAuth.secretName }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.rayAuth.secretName }}
      key: {{ .Values.rayAuth.key }}
{{- end }}
{{- end -}}

{{/* The edge flags both commands take, as a JSON list: ports, traces, TLS, API keys. */}}
{{- define "pdserve.routerEdgeArgs" -}}
{{- $r := .Values.router -}}
{{- if ne (len (uniq (list $r.ports.grpc $r.ports.http $r.ports.metrics))) 3 }}
{{- fail "router.ports: grpc, http and metrics must be three different ports" }}
{{- end }}
{{- $args := list "--port" (toString $r.ports.grpc) "--http-port" (toString $r.ports.http) "--metrics-port" (toString $r.ports.metrics) -}}
{{- if .Values.otel.endpoint -}}
{{- $args = concat $args (list "--trace-exporter" "otlp-grpc" "--trace-endpoint" .Values.otel.endpoint "--trace-sample-ratio" (toString .Values.otel.sampleRatio)) -}}
{{- end -}}
{{- if .Values.tls.enabled -}}
{{- $args = concat $args (list "--ssl-certfile" "/etc/pdserve/tls/tls.crt" "--ssl-keyfile" "/etc/pdserve/tls/tls.key") -}}
{{- if .Values.tls.clientCA -}}
{{- $args = concat $args (list "--ssl-ca-certs" "/etc/pdserve/tls/ca.crt") -}}
{{- end -}}
{{- end -}}
{{- if .Values.apiKeys.secretName -}}
{{- $args = concat $args (list "--api-key-file" (printf "/etc/pdserve/api-keys/%s" .Values.apiKeys.key)) -}}
{{- end -}}
{{- toJson $args -}}
{{- end -}}

{{/*
A router's pod spec; args: dict "root" $ "component" "router"|"router-replica" "script" (the
container's bash script) "gpus" (GPUs the pod requests).
*/}}
{{- define "pdserve.routerPod" -}}
{{- $root := .root -}}
{{- $r := $root.Values.router -}}
{{- $tlsDir := "/etc/pdserve/tls" -}}
metadata:
  {{- include "pdserve.podMetadata" (dict "root" $root "component" .component "pod" $r "extra" (dict "pdserve.io/edge" "router")) | nindent 2 }}
spec:
  {{- with include "pdserve.podSpecCommon" (dict "root" $root "pod" $r) | trim }}
  {{- . | nindent 2 }}
  {{- end }}
  containers:
    - name: router
      image: {{ include "pdserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["/bin/bash", "-c"]
      args:
        - |
          {{- .script | nindent 10 }}
      env:
        {{- include "pdserve.commonEnv" $root | trim | nindent 8 }}
        {{- with include "pdserve.rayAuthEnv" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- /* Keys from Secrets as env, which the server reads: never in argv, where `ps` shows them. */}}
        {{- with $root.Values.apiKeys }}
        {{- if .dataSecretName }}
        - name: PDSERVE_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ .dataSecretName }}
              key: {{ .dataKey }}
        {{- end }}
        {{- if .adminSecretName }}
        - name: PDSERVE_ADMIN_API_KEY
          valueFrom:
            secretKeyRef:
              name: {{ .adminSecretName }}
              key: {{ .adminKey }}
        {{- end }}
        {{- end }}
        {{- with $r.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $r.ports.grpc }}
        - name: http
          containerPort: {{ $r.ports.http }}
        - name: metrics
          containerPort: {{ $r.ports.metrics }}
      {{- /* Readiness asks Inference, which is NOT_SERVING while no decode worker is in placement, so
      traffic goes elsewhere; liveness and start-up ask Admin, SERVING while the process runs, so a
      decode outage does not restart the router. */}}
      {{- $probes := dict }}
      {{- range $kind, $service := dict "ready" "pdserve.v1.Inference" "alive" "pdserve.v1.Admin" }}
      {{- $probe := dict "grpc" (dict "port" $r.ports.grpc "service" $service) }}
      {{- if $root.Values.tls.enabled }}
      {{- /* The kubelet's gRPC probe speaks plaintext only: with TLS the health check runs in the pod. */}}
      {{- $server := $root.Values.tls.serverName | default (printf "%s.%s.svc" (include "pdserve.routerName" $root) $root.Release.Namespace) }}
      {{- $script := printf "import os, grpc\nfrom grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g\nr = lambda p: open(p, 'rb').read()\nc = grpc.ssl_channel_credentials(r('%s/ca.crt'), r('%s/tls.key'), r('%s/tls.crt'))\nch = grpc.secure_channel(os.environ['POD_IP'] + ':%d', c, options=[('grpc.ssl_target_name_override', '%s')])\ns = g.HealthStub(ch).Check(h.HealthCheckRequest(service='%s'), timeout=5).status\nraise SystemExit(0 if s == h.HealthCheckResponse.SERVING else 1)\n" $tlsDir $tlsDir $tlsDir (int $r.ports.grpc) $server $service }}
      {{- $probe = dict "exec" (dict "command" (list "python" "-c" $script)) }}
      {{- end }}
      {{- $_ := set $probes $kind $probe }}
      {{- end }}
      {{- $p := $r.probes }}
      {{- /* The TLS probe's own call waits up to 5 s, so its exec gets at least 10. */}}
      {{- $timeout := ternary (max 10 (int $p.timeoutSeconds)) (int $p.timeoutSeconds) $root.Values.tls.enabled }}
      startupProbe:
        {{- toYaml $probes.alive | nindent 8 }}
        periodSeconds: {{ $p.periodSeconds }}
        timeoutSeconds: {{ $timeout }}
        failureThreshold: {{ $p.startupFailureThreshold }}
      readinessProbe:
        {{- toYaml $probes.ready | nindent 8 }}
        periodSeconds: {{ $p.periodSeconds }}
        timeoutSeconds: {{ $timeout }}
        failureThreshold: {{ $p.readinessFailureThreshold }}
      livenessProbe:
        {{- toYaml $probes.alive | nindent 8 }}
        periodSeconds: {{ $p.periodSeconds }}
        timeoutSeconds: {{ $timeout }}
        failureThreshold: {{ $p.livenessFailureThreshold }}
      {{- with $r.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- $gpus := int (.gpus | default 0) }}
      resources:
        requests:
          cpu: {{ $r.cpu | quote }}
          memory: {{ $r.memory | quote }}
          {{- if gt $gpus 0 }}
          {{ $root.Values.gpuResourceName }}: {{ $gpus | quote }}
          {{- end }}
        limits:
          cpu: {{ $r.cpu | quote }}
          memory: {{ $r.memory | quote }}
          {{- if gt $gpus 0 }}
          {{ $root.Values.gpuResourceName }}: {{ $gpus | quote }}
          {{- end }}
      volumeMounts:
        - name: dshm
          mountPath: /dev/shm
        {{- with include "pdserve.modelMounts" $root | trim }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- if $root.Values.tls.enabled }}
        - name: tls
          mountPath: {{ $tlsDir }}
          readOnly: true
        {{- end }}
        {{- if $root.Values.apiKeys.secretName }}
        - name: api-keys
          mountPath: /etc/pdserve/api-keys
          readOnly: true
        {{- end }}
        {{- with $r.extraVolumeMounts }}
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
    {{- if $root.Values.tls.enabled }}
    - name: tls
      secret:
        secretName: {{ $root.Values.tls.secretName }}
    {{- end }}
    {{- if $root.Values.apiKeys.secretName }}
    - name: api-keys
      secret:
        secretName: {{ $root.Values.apiKeys.secretName }}
    {{- end }}
    {{- with $r.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}

{{/* The script's first part in every router pod: wait for the head, then join Ray as a node that offers no CPU and no GPU. */}}
{{- define "pdserve.routerJoinRay" -}}
{{- $head := include "pdserve.headService" . -}}
set -euo pipefail
# The router process is a Ray driver: it joins the cluster as a node that offers no CPU and no
# GPU to Ray, so no pdserve worker is placed here.
until ray health-check --address {{ $head }}:6379 >/dev/null 2>&1; do
  echo "waiting for the Ray head {{ $head }}:6379"; sleep 5
done
ray start --address={{ $head }}:6379 --node-ip-address="$POD_IP" --num-cpus=0 --num-gpus=0 --disable-usage-stats
{{- end -}}
