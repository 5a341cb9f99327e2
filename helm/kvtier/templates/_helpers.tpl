{{- define "kvtier.fullname" -}}{{ .Release.Name }}{{- end -}}
{{- define "kvtier.image" -}}{{ .Values.image.repository }}:{{ .Values.image.tag }}{{- end -}}
{{- define "kvtier.labels" -}}
app.kubernetes.io/name: kvtier
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}
{{- define "kvtier.storeHeadless" -}}{{ include "kvtier.fullname" . }}-store-headless{{- end -}}
{{- define "kvtier.routerService" -}}{{ include "kvtier.fullname" . }}-router{{- end -}}
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
