{{/* Base name of every object: the release name, with "remora" once. */}}
{{- define "remora.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator's Deployment, Service, ServiceAccount, webhook configuration. */}}
{{- define "remora.operator" -}}
{{- printf "%s-operator" (include "remora.fullname" .) -}}
{{- end -}}

{{/* The Service of a release installed before the rename (remora-injector):
sidecars injected then dial the workload CA at that Service's ClusterIP, so
the chart keeps the same object (and address) while it exists ("auto"), or
when told (true). Empty: not kept. */}}
{{- define "remora.injectorService" -}}
{{- $name := printf "%s-injector" (include "remora.fullname" .) -}}
{{- $keep := toString .Values.operator.keepInjectorService -}}
{{- if .Values.workloadCA.enabled -}}
{{- if or (eq $keep "true") (and (eq $keep "auto") (lookup "v1" "Service" .Release.Namespace $name)) -}}
{{- $name -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "remora.tlsSecret" -}}
{{- printf "%s-tls" (include "remora.operator" .) -}}
{{- end -}}

{{/* The workload CA's signing Secret (the operator's default, contract's SIGNING_SECRET). */}}
{{- define "remora.workloadCASecret" -}}
remora-workload-ca
{{- end -}}

{{/* The trust-bundle ConfigMap in every injected namespace (contract's TRUST_BUNDLE_CONFIGMAP). */}}
{{- define "remora.trustBundleConfigMap" -}}
remora-ca-root-cert
{{- end -}}

{{- define "remora.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: remora
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "remora.selectorLabels" -}}
app.kubernetes.io/name: remora-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* repository:tag or repository@digest. */}}
{{- define "remora.image" -}}
{{- $img := index . 0 -}}{{- $tag := index . 1 -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "remora.operatorImage" -}}
{{- include "remora.image" (list .Values.image.operator (.Values.image.operator.tag | default .Chart.AppVersion)) -}}
{{- end -}}

{{- define "remora.proxyImage" -}}
{{- $tag := .Values.image.proxy.tag | default (printf "%s-envoy-%s" .Chart.AppVersion .Values.image.proxy.envoyVersion) -}}
{{- include "remora.image" (list .Values.image.proxy $tag) -}}
{{- end -}}

{{/*
Namespaces never sent to the webhook: the configured system namespaces and
the release namespace (so the operator's own pods start while it is down,
with failurePolicy Fail).
*/}}
{{- define "remora.excludedNamespaces" -}}
{{- $ns := concat .Values.webhook.excludeNamespaces (list .Release.Namespace) | uniq -}}
{{- toJson $ns -}}
{{- end -}}
