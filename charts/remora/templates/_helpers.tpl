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
{{- if include "remora.workloadCA" . -}}
{{- if or (eq $keep "true") (and (eq $keep "auto") (lookup "v1" "Service" .Release.Namespace $name)) -}}
{{- $name -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* What the release's running operator was installed with: "true" or
"false" for the env var `name` of its Deployment (the one named as now, else
one installed as remora-injector), or "" when there is none. `lookup` finds
nothing under `helm template` and a client-side dry run. */}}
{{- define "remora.installed" -}}
{{- $ctx := index . 0 -}}{{- $env := index . 1 -}}
{{- $found := "" -}}
{{- range $name := list (include "remora.operator" $ctx) (printf "%s-injector" (include "remora.fullname" $ctx)) -}}
{{- if not $found -}}
{{- with lookup "apps/v1" "Deployment" $ctx.Release.Namespace $name -}}
{{- $found = "false" -}}
{{- range .spec.template.spec.containers -}}
{{- range (.env | default list) -}}
{{- if and (eq .name $env) (eq (toString .value) "true") -}}{{- $found = "true" -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{/* The workload CA on: "true", else "" (so `if include ...` reads it).
values.yaml, workloadCA.enabled: true/false win; "auto" is on for a new
install and keeps what an existing release runs with on upgrade (off when
`helm upgrade` finds no operator Deployment to ask). */}}
{{- define "remora.workloadCA" -}}
{{- $v := toString .Values.workloadCA.enabled -}}
{{- if eq $v "auto" -}}
{{- $had := include "remora.installed" (list . "REMORA_WORKLOAD_CA") -}}
{{- if $had -}}
{{- if eq $had "true" }}true{{ end -}}
{{- else if not .Release.IsUpgrade -}}
true
{{- end -}}
{{- else if eq $v "true" -}}
true
{{- end -}}
{{- end -}}

{{/* Service discovery on: "true", else "". "auto" as for the workload CA,
and never without it (it serves with the CA's certificate); an explicit
true without the CA is refused with a message. */}}
{{- define "remora.discovery" -}}
{{- $v := toString .Values.discovery.enabled -}}
{{- $ca := include "remora.workloadCA" . -}}
{{- if eq $v "auto" -}}
{{- if $ca -}}
{{- $had := include "remora.installed" (list . "REMORA_DISCOVERY") -}}
{{- if $had -}}
{{- if eq $had "true" }}true{{ end -}}
{{- else if not .Release.IsUpgrade -}}
true
{{- end -}}
{{- end -}}
{{- else if eq $v "true" -}}
{{- if not $ca -}}
{{- fail "discovery.enabled needs workloadCA.enabled: the discovery server serves with the workload CA's certificate, and sidecars check it with the CA's trust bundle. Set workloadCA.enabled to true (or auto: on for a new install), or discovery.enabled to false (or auto, which is off without the CA)." -}}
{{- end -}}
true
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
