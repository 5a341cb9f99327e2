{{- define "kvtier.fullname" -}}{{ .Release.Name }}{{- end -}}
{{- define "kvtier.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}
{{- define "kvtier.labels" -}}
app.kubernetes.io/name: kvtier
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
{{- define "kvtier.storeHeadless" -}}{{ include "kvtier.fullname" . }}-store-headless{{- end -}}
{{- define "kvtier.routerService" -}}{{ include "kvtier.fullname" . }}-router{{- end -}}
{{- /* Resolves to every router replica: sources publish to each. */ -}}
{{- /* "true" when the frontend is rendered: vLLM engines (it reads their KV events) and frontend.enabled. */ -}}
{{- define "kvtier.frontendOn" -}}{{ if and .Values.engine.enabled .Values.frontend.enabled (eq .Values.engine.kind "vllm") }}true{{ end }}{{- end -}}
{{- define "kvtier.frontendService" -}}{{ include "kvtier.fullname" . }}-frontend{{- end -}}
{{- define "kvtier.frontendHeadless" -}}{{ include "kvtier.fullname" . }}-frontend-headless{{- end -}}
{{- define "kvtier.engineHeadless" -}}{{ include "kvtier.fullname" . }}-engine-headless{{- end -}}
{{- define "kvtier.prefillHeadless" -}}{{ include "kvtier.fullname" . }}-engine-prefill-headless{{- end -}}
{{- define "kvtier.routerHeadless" -}}{{ include "kvtier.fullname" . }}-router-headless{{- end -}}
{{- /* The Secret holding the admin token, or "" when admin RPCs are open. */ -}}
{{- define "kvtier.adminTokenSecret" -}}
{{- if .Values.store.adminTokenSecret -}}{{ .Values.store.adminTokenSecret }}
{{- else if .Values.store.generateAdminToken -}}{{ include "kvtier.fullname" . }}-admin-token
{{- end -}}
{{- end -}}
{{- /* Comma-separated store shard addresses (stable StatefulSet DNS names). */ -}}
{{- define "kvtier.storeAddresses" -}}
{{- $root := . -}}
{{- range $i, $e := until (int .Values.store.replicas) -}}
{{- if $i }},{{ end -}}
{{ include "kvtier.fullname" $root }}-store-{{ $i }}.{{ include "kvtier.storeHeadless" $root }}:{{ $root.Values.store.grpcPort }}
{{- end -}}
{{- end -}}
{{- define "kvtier.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}
{{- /*
A component's scheduling and pod-level settings, from its values
(list $ VALUES COMPONENT): image pull secrets, node selector, tolerations,
affinity, a topology spread over nodes (on by default: two store shards on
one node are lost together), the termination grace period. Values pass
through as JSON, which YAML reads as it is.
*/ -}}
{{- define "kvtier.podScheduling" -}}
{{- $ := index . 0 }}{{- $v := index . 1 }}{{- $component := index . 2 }}
{{- with $.Values.imagePullSecrets }}
imagePullSecrets: {{ toJson . }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector: {{ toJson . }}
{{- end }}
{{- with $v.tolerations }}
tolerations: {{ toJson . }}
{{- end }}
{{- with $v.affinity }}
affinity: {{ toJson . }}
{{- end }}
{{- if $v.topologySpread.enabled }}
topologySpreadConstraints:
  - maxSkew: {{ $v.topologySpread.maxSkew }}
    topologyKey: {{ $v.topologySpread.topologyKey }}
    whenUnsatisfiable: {{ $v.topologySpread.whenUnsatisfiable }}
    labelSelector:
      matchLabels:
        app.kubernetes.io/instance: {{ $.Release.Name }}
        app.kubernetes.io/component: {{ $component }}
{{- end }}
terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
{{- end -}}
{{- /*
Pod annotations: the Prometheus scrape ones (metrics.annotations) and the
component's podAnnotations (list $ VALUES).
*/ -}}
{{- define "kvtier.podAnnotations" -}}
{{- $ := index . 0 }}{{- $v := index . 1 }}
{{- if or $.Values.metrics.annotations $v.podAnnotations }}
annotations:
  {{- if $.Values.metrics.annotations }}
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ $v.metricsPort | quote }}
  prometheus.io/path: /metrics
  {{- end }}
  {{- range $k, $val := $v.podAnnotations }}
  {{ $k }}: {{ $val | quote }}
  {{- end }}
{{- end }}
{{- end -}}
{{- /*
A container's start-up probe, extra args and env, and its preStop
(list $ VALUES PORT SERVICE): the start-up probe gives RocksDB's recovery of
a large NVMe tier its time before liveness counts; preStop waits while
endpoints drop the pod, then SIGTERM lets the process drain within the
grace period.
*/ -}}
{{- define "kvtier.startupProbe" -}}
{{- $ := index . 0 }}{{- $v := index . 1 }}
startupProbe:
  {{- include "kvtier.probe" (list $ (index . 2) (index . 3)) | nindent 2 }}
  periodSeconds: {{ $v.startupProbe.periodSeconds }}
  failureThreshold: {{ $v.startupProbe.failureThreshold }}
lifecycle:
  preStop:
    exec:
      command: ["/bin/sh", "-c", "sleep {{ $v.preStopSeconds }}"]
{{- end -}}
{{- define "kvtier.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
{{- /* TLS flags of a kvtier process (server and client), when tls.enabled. */ -}}
{{- define "kvtier.tlsArgs" -}}
{{- if .Values.tls.enabled }}
- --tls-cert=/etc/kvtier/tls/tls.crt
- --tls-key=/etc/kvtier/tls/tls.key
- --tls-ca=/etc/kvtier/tls/ca.crt
{{- if .Values.tls.requireClientCert }}
- --tls-require-client-cert
{{- end }}
{{- end }}
{{- end -}}
{{- /* Environment that points kvctl, run in a store or router pod with
kubectl exec, at every shard and the router (and their TLS files). */ -}}
{{- define "kvtier.kvctlEnv" -}}
- name: KVTIER_STORE
  value: {{ include "kvtier.storeAddresses" . | quote }}
- name: KVTIER_ROUTER
  value: "{{ include "kvtier.routerService" . }}:{{ .Values.router.grpcPort }}"
{{- if .Values.tls.enabled }}
- name: KVTIER_TLS_CA
  value: /etc/kvtier/tls/ca.crt
- name: KVTIER_TLS_CERT
  value: /etc/kvtier/tls/tls.crt
- name: KVTIER_TLS_KEY
  value: /etc/kvtier/tls/tls.key
{{- end }}
{{- end -}}
{{- define "kvtier.tlsVolumeMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/kvtier/tls
  readOnly: true
{{- end }}
{{- end -}}
{{- define "kvtier.tlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- end -}}
{{- /* Readiness/liveness probe body: grpc.health.v1 on port; with TLS the
kubelet's gRPC probe cannot connect, so kvctl health runs in the pod.
Arguments: (list root port serverName). */ -}}
{{- define "kvtier.probe" -}}
{{- $root := index . 0 -}}
{{- $port := index . 1 -}}
{{- if $root.Values.tls.enabled }}
exec:
  command: ["kvctl", "health", "127.0.0.1:{{ $port }}", "--timeout=3s",
            "--tls-ca=/etc/kvtier/tls/ca.crt", "--tls-cert=/etc/kvtier/tls/tls.crt",
            "--tls-key=/etc/kvtier/tls/tls.key", "--tls-server-name={{ index . 2 }}"]
{{- else }}
grpc:
  port: {{ $port }}
{{- end }}
{{- end -}}

{{- /* The labels that mark an inference worker for the NetworkPolicies. */ -}}
{{- define "kvtier.workerLabels" -}}
{{- range $k, $v := .Values.networkPolicy.workerLabels }}
{{ $k }}: {{ $v | quote }}
{{- end -}}
{{- end -}}
