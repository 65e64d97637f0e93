// Command check validates the manifests of deploy/kubernetes: every document
// decodes strictly into the Kubernetes API type of its kind (an unknown or
// misspelt field, or a value of the wrong type, is an error), and the
// manifests agree with each other and with what the dedup binaries serve:
//
//   - kustomization.yaml lists every manifest of the directory;
//   - every probe is an HTTP GET on a named port of its container, on a path
//     the binaries serve (/livez, /readyz, /healthz), liveness on /livez and
//     readiness on /readyz (an outage makes a consumer unready, and must
//     never restart it);
//   - METRICS_ADDR, from the container's ConfigMap, binds the port the
//     probes and the Prometheus annotation use;
//   - every ConfigMap and Secret a container reads exists, and the
//     container gets DATABASE_URL and KAFKA_BROKERS;
//   - the StatefulSet's group.instance.id is the pod's name (static
//     membership), its governing Service is headless and selects its pods;
//   - every workload sets resource requests and a memory limit, and has a
//     PodDisruptionBudget selecting its pods.
//
// Usage: go run . DIR (scripts/test.sh runs it on deploy/kubernetes).
package main

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"sigs.k8s.io/yaml"
)

// The paths the dedup binaries serve (dedup-kafka's serve_http).
var served = map[string]bool{"/livez": true, "/readyz": true, "/healthz": true, "/metrics": true}

type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
}

type objects struct {
	configMaps   map[string]*corev1.ConfigMap
	secrets      map[string]*corev1.Secret
	services     map[string]*corev1.Service
	statefulSets []*appsv1.StatefulSet
	deployments  []*appsv1.Deployment
	budgets      []*policyv1.PodDisruptionBudget
}

type checker struct{ problems []string }

func (c *checker) fail(format string, args ...any) {
	c.problems = append(c.problems, fmt.Sprintf(format, args...))
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: check DIR")
		os.Exit(2)
	}
	c := &checker{}
	objs := c.load(os.Args[1])
	c.crossCheck(objs)
	if len(c.problems) > 0 {
		for _, p := range c.problems {
			fmt.Fprintln(os.Stderr, "deploy check:", p)
		}
		os.Exit(1)
	}
	fmt.Printf("deploy check: %d ConfigMaps, %d Secrets, %d Services, %d StatefulSets, %d Deployments, %d PodDisruptionBudgets: all valid\n",
		len(objs.configMaps), len(objs.secrets), len(objs.services), len(objs.statefulSets), len(objs.deployments), len(objs.budgets))
}

// load decodes every manifest of dir strictly, by its kind.
func (c *checker) load(dir string) *objects {
	objs := &objects{
		configMaps: map[string]*corev1.ConfigMap{},
		secrets:    map[string]*corev1.Secret{},
		services:   map[string]*corev1.Service{},
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil || len(files) == 0 {
		c.fail("no manifests in %s", dir)
		return objs
	}
	var listed []string
	var manifests []string
	for _, file := range files {
		text, err := os.ReadFile(file)
		if err != nil {
			c.fail("%s: %v", file, err)
			continue
		}
		base := filepath.Base(file)
		if base == "kustomization.yaml" {
			// Kustomize has many fields of its own: only its resources
			// are read.
			var k kustomization
			if err := yaml.Unmarshal(text, &k); err != nil || k.Kind != "Kustomization" {
				c.fail("%s: not a Kustomization: %v", base, err)
			}
			listed = k.Resources
			continue
		}
		manifests = append(manifests, base)
		for i, doc := range documents(text) {
			c.decode(objs, fmt.Sprintf("%s#%d", base, i+1), doc)
		}
	}
	sort.Strings(listed)
	sort.Strings(manifests)
	if strings.Join(listed, ",") != strings.Join(manifests, ",") {
		c.fail("kustomization.yaml lists %v, the directory holds %v", listed, manifests)
	}
	return objs
}

// documents splits a YAML stream at its `---` lines (CRLF or LF, with or
// without a leading one), leaving out documents that hold only comments.
func documents(text []byte) [][]byte {
	text = bytes.ReplaceAll(text, []byte("\r\n"), []byte("\n"))
	var docs [][]byte
	var current []byte
	flush := func() {
		for _, line := range bytes.Split(current, []byte("\n")) {
			trimmed := bytes.TrimSpace(line)
			if len(trimmed) > 0 && trimmed[0] != '#' {
				docs = append(docs, current)
				break
			}
		}
		current = nil
	}
	for _, line := range bytes.SplitAfter(text, []byte("\n")) {
		if bytes.Equal(bytes.TrimRight(line, " \t\n"), []byte("---")) {
			flush()
			continue
		}
		current = append(current, line...)
	}
	flush()
	return docs
}

func (c *checker) decode(objs *objects, where string, doc []byte) {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
	}
	if err := yaml.Unmarshal(doc, &head); err != nil {
		c.fail("%s: not YAML: %v", where, err)
		return
	}
	strict := func(into any) bool {
		if err := yaml.UnmarshalStrict(doc, into); err != nil {
			c.fail("%s (%s): %v", where, head.Kind, err)
			return false
		}
		return true
	}
	switch head.APIVersion + " " + head.Kind {
	case "v1 ConfigMap":
		var o corev1.ConfigMap
		if strict(&o) {
			objs.configMaps[o.Name] = &o
		}
	case "v1 Secret":
		var o corev1.Secret
		if strict(&o) {
			objs.secrets[o.Name] = &o
		}
	case "v1 Service":
		var o corev1.Service
		if strict(&o) {
			objs.services[o.Name] = &o
		}
	case "apps/v1 StatefulSet":
		var o appsv1.StatefulSet
		if strict(&o) {
			objs.statefulSets = append(objs.statefulSets, &o)
		}
	case "apps/v1 Deployment":
		var o appsv1.Deployment
		if strict(&o) {
			objs.deployments = append(objs.deployments, &o)
		}
	case "policy/v1 PodDisruptionBudget":
		var o policyv1.PodDisruptionBudget
		if strict(&o) {
			objs.budgets = append(objs.budgets, &o)
		}
	default:
		c.fail("%s: unexpected kind %q (apiVersion %q)", where, head.Kind, head.APIVersion)
	}
}

func (c *checker) crossCheck(objs *objects) {
	for _, s := range objs.statefulSets {
		name := "StatefulSet " + s.Name
		c.workload(objs, name, &s.Spec.Template)
		c.budgeted(objs, name, s.Spec.Template.Labels)
		c.selects(name, s.Spec.Selector.MatchLabels, s.Spec.Template.Labels)
		svc, ok := objs.services[s.Spec.ServiceName]
		switch {
		case !ok:
			c.fail("%s: its serviceName %q is no Service here", name, s.Spec.ServiceName)
		case svc.Spec.ClusterIP != corev1.ClusterIPNone:
			c.fail("%s: its Service %q is not headless", name, svc.Name)
		default:
			c.selects("Service "+svc.Name, svc.Spec.Selector, s.Spec.Template.Labels)
		}
		for _, ct := range s.Spec.Template.Spec.Containers {
			if !instanceIDIsPodName(ct) {
				c.fail("%s/%s: KAFKA_CFG_GROUP_INSTANCE_ID must come from metadata.name (static membership)", name, ct.Name)
			}
		}
	}
	for _, d := range objs.deployments {
		name := "Deployment " + d.Name
		c.workload(objs, name, &d.Spec.Template)
		c.budgeted(objs, name, d.Spec.Template.Labels)
		c.selects(name, d.Spec.Selector.MatchLabels, d.Spec.Template.Labels)
	}
	if len(objs.statefulSets)+len(objs.deployments) == 0 {
		c.fail("no workload")
	}
}

// selects checks that selector picks pods labelled labels.
func (c *checker) selects(what string, selector, labels map[string]string) {
	if len(selector) == 0 {
		c.fail("%s: empty selector", what)
	}
	for k, v := range selector {
		if labels[k] != v {
			c.fail("%s: selector %s=%s does not match the pods' labels %v", what, k, v, labels)
		}
	}
}

func (c *checker) budgeted(objs *objects, what string, labels map[string]string) {
	for _, b := range objs.budgets {
		if b.Spec.Selector == nil {
			continue
		}
		all := len(b.Spec.Selector.MatchLabels) > 0
		for k, v := range b.Spec.Selector.MatchLabels {
			all = all && labels[k] == v
		}
		if all {
			return
		}
	}
	c.fail("%s: no PodDisruptionBudget selects its pods", what)
}

func instanceIDIsPodName(ct corev1.Container) bool {
	for _, e := range ct.Env {
		if e.Name == "KAFKA_CFG_GROUP_INSTANCE_ID" {
			return e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "metadata.name"
		}
	}
	return false
}

// workload checks a pod template's containers: probes, ports, environment,
// resources.
func (c *checker) workload(objs *objects, what string, t *corev1.PodTemplateSpec) {
	if len(t.Spec.Containers) == 0 {
		c.fail("%s: no container", what)
	}
	for _, ct := range t.Spec.Containers {
		where := what + "/" + ct.Name
		env := c.environment(objs, where, ct)
		for _, need := range []string{"DATABASE_URL", "KAFKA_BROKERS", "METRICS_ADDR"} {
			if _, ok := env[need]; !ok {
				c.fail("%s: no %s in its environment", where, need)
			}
		}
		ports := map[string]int32{}
		for _, p := range ct.Ports {
			ports[p.Name] = p.ContainerPort
		}
		var metricsPort string
		if addr, ok := env["METRICS_ADDR"]; ok {
			_, port, err := net.SplitHostPort(addr)
			if err != nil {
				c.fail("%s: METRICS_ADDR %q: %v", where, addr, err)
			}
			metricsPort = port
		}
		probes := []struct {
			kind  string
			probe *corev1.Probe
			path  string
		}{
			{"startupProbe", ct.StartupProbe, "/livez"},
			{"livenessProbe", ct.LivenessProbe, "/livez"},
			{"readinessProbe", ct.ReadinessProbe, "/readyz"},
		}
		for _, p := range probes {
			if p.probe == nil || p.probe.HTTPGet == nil {
				c.fail("%s: no HTTP %s", where, p.kind)
				continue
			}
			get := p.probe.HTTPGet
			if !served[get.Path] {
				c.fail("%s: %s on %q, which the binary does not serve", where, p.kind, get.Path)
			}
			if get.Path != p.path {
				c.fail("%s: %s on %q; it must be %q", where, p.kind, get.Path, p.path)
			}
			port, ok := ports[get.Port.String()]
			if !ok {
				c.fail("%s: %s on port %q, which is no named port of the container", where, p.kind, get.Port.String())
			} else if fmt.Sprint(port) != metricsPort {
				c.fail("%s: %s on port %d, but METRICS_ADDR serves on %s", where, p.kind, port, metricsPort)
			}
		}
		if annotated := t.Annotations["prometheus.io/port"]; annotated != "" && annotated != metricsPort {
			c.fail("%s: prometheus.io/port %s, but METRICS_ADDR serves on %s", where, annotated, metricsPort)
		}
		if path := t.Annotations["prometheus.io/path"]; path != "" && path != "/metrics" {
			c.fail("%s: prometheus.io/path %q is not /metrics", where, path)
		}
		r := ct.Resources
		if r.Requests.Cpu().IsZero() || r.Requests.Memory().IsZero() || r.Limits.Memory().IsZero() {
			c.fail("%s: set cpu and memory requests and a memory limit", where)
		}
	}
}

// environment is what the container's variables are, from its envFrom
// ConfigMaps and Secrets and its own env (a value from a field counts as set).
func (c *checker) environment(objs *objects, where string, ct corev1.Container) map[string]string {
	env := map[string]string{}
	for _, from := range ct.EnvFrom {
		switch {
		case from.ConfigMapRef != nil:
			cm, ok := objs.configMaps[from.ConfigMapRef.Name]
			if !ok {
				c.fail("%s: reads ConfigMap %q, which is not here", where, from.ConfigMapRef.Name)
				continue
			}
			for k, v := range cm.Data {
				env[k] = v
			}
		case from.SecretRef != nil:
			s, ok := objs.secrets[from.SecretRef.Name]
			if !ok {
				c.fail("%s: reads Secret %q, which is not here", where, from.SecretRef.Name)
				continue
			}
			for k, v := range s.StringData {
				env[k] = v
			}
			for k, v := range s.Data {
				env[k] = string(v)
			}
		}
	}
	for _, e := range ct.Env {
		env[e.Name] = e.Value
	}
	return env
}
