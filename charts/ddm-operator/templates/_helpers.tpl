{{/* The release's name for its objects, within the 63 characters of a label value. */}}
{{- define "ddm-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator's pod; never change on upgrade. */}}
{{- define "ddm-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ddm-operator.labels" -}}
{{ include "ddm-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "ddm-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ddm-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image with images.tag (default appVersion) added unless it has a tag or digest. */}}
{{- define "ddm-operator.image" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- $last := $image | splitList "/" | last -}}
{{- if or (contains ":" $last) (contains "@" $image) -}}
{{- $image -}}
{{- else -}}
{{- printf "%s:%s" $image (default $root.Chart.AppVersion $root.Values.images.tag) -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in each namespace it serves: exactly the verbs it uses. */}}
{{- define "ddm-operator.namespacedRules" -}}
- apiGroups: [ddm.dev]
  resources: [ddmdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [ddm.dev]
  resources: [ddmdeployments/status]
  verbs: [get, patch, update]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: [ddm.dev]
  resources: [ddmdeployments/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [services, configmaps]
  verbs: [get, list, watch, create, patch, update, delete]
# Expert pods are read (never changed) to say in the status why an expert is not ready.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, update, delete]
# The operator's own Secrets: each router's token (created once, never read back) and the URIs
# of fetched checkpoints (applied). `get` is for their metadata only: the operator asks for a
# PartialObjectMetadata, to tell its own Secrets from ones planted under their names.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, get, patch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end -}}
