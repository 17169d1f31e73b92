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

{{/* The rules the operator needs in each namespace it serves: exactly the verbs it uses, as
tests/integration/test_operator_rbac.py proves from the API server's audit log. Children are
written by server-side apply (patch; create when the apply creates), never by update. */}}
{{- define "ddm-operator.namespacedRules" -}}
# kopf watches DDMDeployments and keeps its progress in their annotations (patch).
- apiGroups: [ddm.dev]
  resources: [ddmdeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [ddm.dev]
  resources: [ddmdeployments/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion need update on the owner's finalizers (checked by
# the OwnerReferencesPermissionEnforcement admission plugin where it is on; never a request).
- apiGroups: [ddm.dev]
  resources: [ddmdeployments/finalizers]
  verbs: [update]
# Deployments and Services: an expert removed from the spec takes its own with it.
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
# One ConfigMap per DDMDeployment (router.yaml), removed only with it (by the garbage collector).
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch]
# Removed when the networkPolicy setting is turned off.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# Expert pods are read (never changed) to say in the status why an expert is not ready.
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
# DDMTrainings: watched, their status written; the DDMDeployment of their outputs is created
# (above: create is not needed there otherwise).
- apiGroups: [ddm.dev]
  resources: [ddmtrainings]
  verbs: [get, list, watch, patch]
- apiGroups: [ddm.dev]
  resources: [ddmtrainings/status]
  verbs: [patch]
- apiGroups: [ddm.dev]
  resources: [ddmtrainings/finalizers]
  verbs: [update]
- apiGroups: [ddm.dev]
  resources: [ddmdeployments]
  verbs: [create]
# A training's jobs (engine: job; the partition under either engine): created, never changed;
# deleted only by the garbage collector with their DDMTraining.
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, watch, create]
# The training pods' logs: the steps their rank-0 process last printed (the status's progress).
- apiGroups: [""]
  resources: [pods/log]
  verbs: [get]
{{- if .Values.kubeflowTrainer }}
# engine: kubeflow-trainer: one TrainJob per expert and for the router network.
- apiGroups: [trainer.kubeflow.org]
  resources: [trainjobs]
  verbs: [list, create]
{{- end }}
# The operator's own Secrets (the tokens, the URIs of fetched checkpoints): immutable, named
# after what they hold, created once and never read, changed or deleted by the operator (the
# garbage collector removes them with their DDMDeployment). No get, list, watch or patch.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
# kopf posts the events it is told to (core v1 events, created, never patched).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}
