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
