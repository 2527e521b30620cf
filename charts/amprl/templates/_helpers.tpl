{{/*
Names. Every object is "<release>-amprl-<component>", never shortened or truncated: the
documented `kubectl scale deployment/<release>-amprl-actor` must name the real Deployment.
A release name longer than 36 characters would push the longest derived names (StatefulSet
revision labels, headless Service names) past the 63-character DNS label limit, so it fails
at render time instead.
*/}}
{{- define "amprl.name" -}}
{{- .Chart.Name -}}
{{- end -}}

{{- define "amprl.fullname" -}}
{{- if gt (len .Release.Name) 36 -}}
{{- fail (printf "release name %q is %d characters; AMP-RL needs at most 36 so that derived names such as %s-amprl-replay-headless stay valid DNS labels" .Release.Name (len .Release.Name) .Release.Name) -}}
{{- end -}}
{{- printf "%s-%s" .Release.Name .Chart.Name -}}
{{- end -}}

{{/* "<release>-amprl-<component>"; call with (dict "ctx" $ "component" "actor"). */}}
{{- define "amprl.componentName" -}}
{{- printf "%s-%s" (include "amprl.fullname" .ctx) .component -}}
{{- end -}}

{{- define "amprl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" -}}
{{- end -}}

{{/* Selector labels of one component; stable across upgrades (never add the version). */}}
{{- define "amprl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "amprl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Standard labels of one component's objects and pods. */}}
{{- define "amprl.labels" -}}
{{ include "amprl.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: amprl
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "amprl.chart" .ctx }}
{{- end -}}

{{/* Labels of release-wide objects (ConfigMap, default-deny policy). */}}
{{- define "amprl.commonLabels" -}}
app.kubernetes.io/name: {{ include "amprl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: amprl
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "amprl.chart" . }}
{{- end -}}

{{/* repository@digest when a digest is set, else repository:tag. Call with an image map. */}}
{{- define "amprl.imageRef" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository (toString .tag) -}}
{{- end -}}
{{- end -}}

{{/* Stable DNS names. */}}
{{- define "amprl.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/*
AMPRL_REPLAY_ADDRESS: every replay shard, in shard order, comma-separated. Shard i is the
StatefulSet pod <release>-amprl-replay-<i>, reached through the headless Service by its
stable name, so an actor or learner always talks to the same shard across restarts.
With one shard this is a single host:port.
*/}}
{{- define "amprl.replayAddress" -}}
{{- $sts := include "amprl.componentName" (dict "ctx" . "component" "replay") -}}
{{- $headless := printf "%s-headless" $sts -}}
{{- $addrs := list -}}
{{- range $i := until (int .Values.replay.shards) -}}
{{- $addrs = append $addrs (printf "%s-%d.%s.%s:%d" $sts $i $headless (include "amprl.svcDomain" $) (int $.Values.replay.port)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* AMPRL_PARAMSERVER_ADDRESS of learners: the push port (every RPC). */}}
{{- define "amprl.paramserverPushAddress" -}}
{{- printf "%s.%s:%d" (include "amprl.componentName" (dict "ctx" . "component" "paramserver")) (include "amprl.svcDomain" .) (int .Values.paramserver.port) -}}
{{- end -}}

{{/* The parameter server's read-only pull port: what followers follow. */}}
{{- define "amprl.paramserverMainPullAddress" -}}
{{- printf "%s.%s:%d" (include "amprl.componentName" (dict "ctx" . "component" "paramserver")) (include "amprl.svcDomain" .) (int .Values.paramserver.pullPort) -}}
{{- end -}}

{{/*
AMPRL_PARAMSERVER_ADDRESS of actors and the evaluator, who only read weights: the
followers' Service when there are followers, else the parameter server's pull port.
*/}}
{{- define "amprl.paramserverPullAddress" -}}
{{- if gt (int .Values.paramserver.followers.replicas) 0 -}}
{{- printf "%s.%s:%d" (include "amprl.componentName" (dict "ctx" . "component" "paramserver-follower")) (include "amprl.svcDomain" .) (int .Values.paramserver.pullPort) -}}
{{- else -}}
{{- include "amprl.paramserverMainPullAddress" . -}}
{{- end -}}
{{- end -}}

{{/*
The pods that pull weights from the parameter server's pull port: the followers when
there are any, else the actors and the evaluator. Peers of a NetworkPolicy rule.
*/}}
{{- define "amprl.paramserverPullPeers" -}}
{{- $components := list "actor" "evaluator" -}}
{{- if gt (int .Values.paramserver.followers.replicas) 0 -}}
{{- $components = list "paramserver-follower" -}}
{{- end -}}
{{- range $components }}
- podSelector:
    matchLabels:
      {{- include "amprl.selectorLabels" (dict "ctx" $ "component" .) | nindent 6 }}
{{- end }}
{{- end -}}

{{- define "amprl.redisSecretName" -}}
{{- default (include "amprl.componentName" (dict "ctx" . "component" "redis")) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{- define "amprl.redisSecretKey" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecretKey -}}
{{- else -}}
redis-password
{{- end -}}
{{- end -}}

{{- define "amprl.redisAdminSecretKey" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{- .Values.redis.auth.existingSecretAdminKey -}}
{{- else -}}
redis-admin-password
{{- end -}}
{{- end -}}

{{/* The Secret with Redis's TLS key pair and the CA replay trusts (redis.tls). */}}
{{- define "amprl.redisTlsSecretName" -}}
{{- default (printf "%s-tls" (include "amprl.componentName" (dict "ctx" . "component" "redis"))) .Values.redis.tls.secretName -}}
{{- end -}}

{{- define "amprl.tlsServerName" -}}
{{- default (include "amprl.fullname" .) .Values.tls.serverName -}}
{{- end -}}

{{/*
Mutual TLS: one key pair per role, so an actor's key cannot pass for the parameter server.
The roles that hold a certificate; paramserver followers are the paramserver role.
*/}}
{{- define "amprl.tlsRoles" -}}
learner actor evaluator replay paramserver operator
{{- end -}}

{{/* Secret of one role; call with (dict "ctx" $ "role" "actor"). */}}
{{- define "amprl.tlsSecretName" -}}
{{- default (printf "%s-tls-%s" (include "amprl.fullname" .ctx) .role) (get .ctx.Values.tls.secrets .role) -}}
{{- end -}}

{{/*
Refuses TLS settings that would silently weaken it: the removed single tls.secretName
(one key pair in every pod), and two roles sharing a Secret. Renders nothing.
*/}}
{{- define "amprl.tlsCheck" -}}
{{- if .Values.tls.secretName -}}
{{- fail (printf "tls.secretName (%q) was removed: one key pair mounted in every pod let any pod pass for the parameter server or replay. Give each role its own Secret in tls.secrets.<role> (learner, actor, evaluator, replay, paramserver; default <release>-amprl-tls-<role>) or set tls.certManager; docs/kubernetes.md, section TLS, shows how to make them" .Values.tls.secretName) -}}
{{- end -}}
{{- $seen := dict -}}
{{- range $role := splitList " " (include "amprl.tlsRoles" .) -}}
{{- $name := include "amprl.tlsSecretName" (dict "ctx" $ "role" $role) -}}
{{- if hasKey $seen $name -}}
{{- fail (printf "tls.secrets.%s and tls.secrets.%s both name the Secret %q: each role needs its own key pair, or the pods of one could act as the other" (get $seen $name) $role $name) -}}
{{- end -}}
{{- $_ := set $seen $name $role -}}
{{- end -}}
{{- end -}}

{{/*
The cert-manager Certificate of one role; call with (dict "ctx" $ "role" "actor"). The role
is named twice, as servers read it (URI SAN spiffe://amprl/<release>/<role>, else CN), and
the DNS SAN <role>.<serverName> is what a client dialing a server of that role expects.
The operator never serves, so its certificate is for client auth only.
*/}}
{{- define "amprl.certificate" -}}
{{- $ctx := .ctx -}}
{{- $cm := $ctx.Values.tls.certManager -}}
{{- include "amprl.tlsCheck" $ctx -}}
apiVersion: cert-manager.io/v1
kind: Certificate
metadata:
  name: {{ printf "%s-tls-%s" (include "amprl.fullname" $ctx) .role }}
  namespace: {{ $ctx.Release.Namespace }}
  labels:
    {{- include "amprl.labels" (dict "ctx" $ctx "component" .role) | nindent 4 }}
spec:
  secretName: {{ include "amprl.tlsSecretName" . }}
  secretTemplate:
    labels:
      {{- include "amprl.labels" (dict "ctx" $ctx "component" .role) | nindent 6 }}
  commonName: {{ .role }}
  uris:
    - {{ printf "spiffe://amprl/%s/%s" $ctx.Release.Name .role }}
  dnsNames:
    - {{ printf "%s.%s" .role (include "amprl.tlsServerName" $ctx) }}
  usages:
    - digital signature
    {{- if ne .role "operator" }}
    - server auth
    {{- end }}
    - client auth
  duration: {{ $cm.duration }}
  renewBefore: {{ $cm.renewBefore }}
  privateKey:
    algorithm: ECDSA
    size: 256
    encoding: PKCS8
    rotationPolicy: Always
  issuerRef:
    name: {{ required "tls.certManager.issuerRef.name is required when tls.certManager.enabled is true" $cm.issuerRef.name }}
    kind: {{ $cm.issuerRef.kind }}
    group: {{ $cm.issuerRef.group }}
{{- end -}}

{{/*
Whether the chart renders the operator's Certificate: "true" or "". People ask for it
(tls.certManager.operator); the done Job's pod needs it.
*/}}
{{- define "amprl.operatorCertificate" -}}
{{- if and (include "amprl.certManager" .) (or .Values.tls.certManager.operator (and .Values.done.enabled .Values.evaluator.enabled)) -}}true{{- end -}}
{{- end -}}

{{/* Whether the chart renders Certificates: "true" or "". */}}
{{- define "amprl.certManager" -}}
{{- if and .Values.tls.enabled .Values.tls.certManager.enabled -}}true{{- end -}}
{{- end -}}

{{/*
The experiment file every service reads (AMPRL_CONFIG), as text: experimentFile as is when
set (`--set-file experimentFile=configs/pong-apex.yaml`), else the experiment mapping as
YAML. A file that is not a YAML mapping fails the render. Templates that need a key read
it from (fromYaml (include "amprl.experimentText" .)).
*/}}
{{- define "amprl.experimentText" -}}
{{- if .Values.experimentFile -}}
{{- $parsed := fromYaml .Values.experimentFile -}}
{{- if hasKey $parsed "Error" -}}
{{- fail (printf "experimentFile is not a YAML mapping: %s" (get $parsed "Error")) -}}
{{- end -}}
{{- .Values.experimentFile -}}
{{- else -}}
{{- toYaml .Values.experiment -}}
{{- end -}}
{{- end -}}

{{/*
AMPRL_EVALUATOR_ADDRESS: the evaluator's Service. Actors and learners ask it whether the
run goes on; the done Job waits on it.
*/}}
{{- define "amprl.evaluatorAddress" -}}
{{- printf "%s.%s:%d" (include "amprl.componentName" (dict "ctx" . "component" "evaluator")) (include "amprl.svcDomain" .) (int .Values.evaluator.port) -}}
{{- end -}}

{{/*
Env of a worker (actor, learner) that follows the run's end: the evaluator's address, when
there is an evaluator (without one the run goes on until the release is removed).
*/}}
{{- define "amprl.runEndEnv" -}}
{{- if .Values.evaluator.enabled }}
# The evaluator decides when the run ends; workers then stop and idle (no exit, no restart).
- name: AMPRL_EVALUATOR_ADDRESS
  value: {{ include "amprl.evaluatorAddress" . | quote }}
{{- end }}
{{- end -}}

{{/* A NetworkPolicy egress rule to the evaluator's port; "" without an evaluator. */}}
{{- define "amprl.evaluatorEgress" -}}
{{- if .Values.evaluator.enabled }}
# The run's state (GetRunState): the evaluator decides when the run ends.
- to:
    - podSelector:
        matchLabels:
          {{- include "amprl.selectorLabels" (dict "ctx" . "component" "evaluator") | nindent 10 }}
  ports:
    - port: {{ .Values.evaluator.port }}
      protocol: TCP
{{- end }}
{{- end -}}

{{/*
Pod-template annotations of the AMP-RL workloads: roll pods when the experiment config
changes; with metrics.enabled, where annotation-based Prometheus configs scrape them.
*/}}
{{- define "amprl.podAnnotations" -}}
checksum/experiment: {{ include "amprl.experimentText" . | sha256sum }}
{{- if .Values.metrics.enabled }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/*
The "metrics" container port of an AMP-RL container (metrics.enabled); "" if off. A
metrics.port equal to one of the gRPC ports fails the render.
*/}}
{{- define "amprl.metricsContainerPort" -}}
{{- if .Values.metrics.enabled }}
{{- $v := .Values }}
{{- range $key, $port := dict "actor.port" $v.actor.port "learner.port" $v.learner.port "evaluator.port" $v.evaluator.port "replay.port" $v.replay.port "paramserver.port" $v.paramserver.port "paramserver.pullPort" $v.paramserver.pullPort }}
{{- if eq (int $port) (int $v.metrics.port) }}
{{- fail (printf "metrics.port (%d) must differ from %s: a container serves gRPC and /metrics on separate ports" (int $v.metrics.port) $key) }}
{{- end }}
{{- end }}
- name: metrics
  containerPort: {{ .Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end -}}

{{/* The "metrics" port of an AMP-RL Service (what a ServiceMonitor scrapes); "" if off. */}}
{{- define "amprl.metricsServicePort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  port: {{ .Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
{{- end }}
{{- end -}}

{{/* The components that serve /metrics: every AMP-RL service, not Redis. */}}
{{- define "amprl.metricsComponents" -}}
actor learner evaluator replay paramserver paramserver-follower
{{- end -}}

{{/* Env every AMP-RL service gets; call with (dict "ctx" $ "port" 50051). */}}
{{- define "amprl.commonEnv" -}}
- name: AMPRL_CONFIG
  value: /etc/amprl/experiment.yaml
- name: AMPRL_HOST
  value: "0.0.0.0"
- name: AMPRL_PORT
  value: {{ .port | quote }}
- name: AMPRL_LOG_LEVEL
  value: {{ .ctx.Values.logLevel | quote }}
- name: AMPRL_LOG_FORMAT
  value: {{ .ctx.Values.logFormat | quote }}
{{- if .drain }}
- name: AMPRL_DRAIN_S
  value: {{ .ctx.Values.drainSeconds | quote }}
{{- end }}
- name: AMPRL_RUN_DIR
  value: /var/lib/amprl
{{- if .ctx.Values.metrics.enabled }}
- name: AMPRL_METRICS_PORT
  value: {{ .ctx.Values.metrics.port | quote }}
{{- end }}
# Prometheus is a cluster's record; event files would only fill the pods' run folders.
- name: AMPRL_TENSORBOARD
  value: "off"
- name: HOME
  value: /tmp
{{- if .ctx.Values.tls.enabled }}
- name: AMPRL_TLS_CERT_DIR
  value: /etc/amprl/tls
- name: AMPRL_TLS_SERVER_NAME
  value: {{ include "amprl.tlsServerName" .ctx | quote }}
{{- end }}
{{- end -}}

{{/* Mounts every AMP-RL container gets (the run directory is added per component). */}}
{{- define "amprl.commonVolumeMounts" -}}
- name: experiment
  mountPath: /etc/amprl/experiment.yaml
  subPath: experiment.yaml
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/amprl/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
Volumes every AMP-RL pod gets; call with (dict "ctx" $ "role" "actor"). With TLS the pod
mounts its own role's Secret and no other, and only the three files the services read.
*/}}
{{- define "amprl.commonVolumes" -}}
- name: experiment
  configMap:
    name: {{ include "amprl.componentName" (dict "ctx" .ctx "component" "experiment") }}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
{{- if .ctx.Values.tls.enabled }}
{{- include "amprl.tlsCheck" .ctx }}
- name: tls
  secret:
    secretName: {{ include "amprl.tlsSecretName" . }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{/*
Probes of an AMP-RL container on its health service; call with (dict "ctx" $ "port" N
"startupSeconds" S). Without TLS they are the kubelet's native gRPC probes. With TLS they
exec the image's probe module, which dials the same port with the mounted CA, because the
native probe cannot speak TLS. The startup probe covers imports and, for replay, rebuilding
the index from Redis; startup and liveness ask the health service "liveness", which a
server reports SERVING for as long as it answers, and readiness asks "" (the whole
server), which follows its dependencies (replay: NOT_SERVING while Redis is unreachable):
a replay without Redis is taken out of its Service, not restarted.
*/}}
{{- define "amprl.grpcProbes" -}}
{{- $ready := dict -}}
{{- $live := dict -}}
{{- if .ctx.Values.tls.enabled -}}
{{- $ready = dict "exec" (dict "command" (list "python" "-m" "amprl.common.healthcheck" "--port" (toString .port))) -}}
{{- $live = dict "exec" (dict "command" (list "python" "-m" "amprl.common.healthcheck" "--service" "liveness" "--port" (toString .port))) -}}
{{- else -}}
{{- $ready = dict "grpc" (dict "port" (int .port)) -}}
{{- $live = dict "grpc" (dict "port" (int .port) "service" "liveness") -}}
{{- end -}}
startupProbe:
  {{- toYaml $live | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: {{ div (int (default 300 .startupSeconds)) 5 }}
livenessProbe:
  {{- toYaml $live | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  {{- toYaml $ready | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 2
{{- end -}}

{{/*
Pod-spec fields every pod shares, plus the component's scheduling (nodeSelector,
tolerations, affinity); call with (dict "ctx" $ "values" .Values.<component>).
*/}}
{{- define "amprl.podCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .ctx.Values.podSecurityContext | nindent 2 }}
{{- with .ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
