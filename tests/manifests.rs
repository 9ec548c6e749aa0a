//! The Kubernetes manifests in `manifests/`: every document parses and carries what a
//! deployment needs (CRD schema, least-privilege RBAC, gRPC probes, a locked-down
//! container); the Envoy configurations inside them pass `envoy --mode validate`; and
//! every query of the Grafana dashboard returns data from a real Prometheus scraping a
//! kvroute that routes traffic through Envoy.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use serde::Deserialize;
use serde_json::{Value, json};

use kvroute::config::{ServeArgs, ServeConfig};

/// The binary's allocator, so the memory gauges the dashboard shows read real counters.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
use kvroute::discovery::inference_pool::InferencePool;
use support::{
    Envoy, FakeMetrics, FakePod, Gateway, Kvroute, envoy_validate, envoy_validate_file,
    http_client, project_file, test_config,
};

// ---------------------------------------------------------------------------------
// Reading the manifests

/// One YAML document of a manifest file.
struct Doc {
    file: PathBuf,
    value: Value,
}

impl Doc {
    fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or_default()
    }

    fn name(&self) -> &str {
        self.value["metadata"]["name"].as_str().unwrap_or_default()
    }
}

fn manifests_dir() -> PathBuf {
    project_file("manifests")
}

/// Every `.yaml` / `.yml` file under `manifests/`, sorted.
fn yaml_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path
                .extension()
                .is_some_and(|ext| ext == "yaml" || ext == "yml")
            {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&manifests_dir(), &mut files);
    files.sort();
    assert!(!files.is_empty(), "no manifests found");
    files
}

fn is_kustomization(path: &Path) -> bool {
    path.file_name().is_some_and(|n| n == "kustomization.yaml")
}

/// Parses every document of a YAML file (empty documents skipped).
fn parse_yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut values = Vec::new();
    for document in serde_norway::Deserializer::from_str(&text) {
        let value = Value::deserialize(document)
            .unwrap_or_else(|e| panic!("{} does not parse: {e}", path.display()));
        if !value.is_null() {
            values.push(value);
        }
    }
    values
}

/// Every Kubernetes object in `manifests/` (kustomizations excluded).
fn documents() -> Vec<Doc> {
    yaml_files()
        .into_iter()
        .filter(|path| !is_kustomization(path))
        .flat_map(|file| {
            parse_yaml_documents(&file)
                .into_iter()
                .map(move |value| Doc {
                    file: file.clone(),
                    value,
                })
        })
        .collect()
}

fn find(docs: &[Doc], kind: &str, name: &str) -> Value {
    let found: Vec<&Doc> = docs
        .iter()
        .filter(|d| d.kind() == kind && d.name() == name)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} {name}, found {}",
        found.len()
    );
    found[0].value.clone()
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {value}"))
        .iter()
        .map(|v| {
            v.as_str()
                .unwrap_or_else(|| panic!("not a string: {v}"))
                .to_owned()
        })
        .collect()
}

fn set(items: &[&str]) -> BTreeSet<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

fn container(pod_spec: &Value, name: &str) -> Value {
    pod_spec["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
        .clone()
}

fn container_port(container: &Value, name: &str) -> u64 {
    container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == name)
        .and_then(|p| p["containerPort"].as_u64())
        .unwrap_or_else(|| panic!("no container port {name} in {}", container["name"]))
}

/// Whether `labels` has every pair of `selector`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let selector = selector.as_object().expect("selector labels");
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// kvroute's own flag parser, as `kvroute serve` would run it.
#[derive(Parser)]
struct ServeCli {
    #[command(flatten)]
    serve: ServeArgs,
}

/// Parses and validates a kvroute container's arguments with kvroute's own config code.
fn kvroute_config(container: &Value) -> ServeConfig {
    let args = strings(&container["args"]);
    assert_eq!(args.first().map(String::as_str), Some("serve"), "{args:?}");
    let cli = ServeCli::try_parse_from(
        std::iter::once("kvroute".to_owned())
            .chain(args[1..].iter().cloned())
            // The manifest takes the namespace from the downward API.
            .chain(["--pool-namespace".to_owned(), "llm".to_owned()]),
    )
    .unwrap_or_else(|e| panic!("kvroute rejects the manifest's args {args:?}: {e}"));
    ServeConfig::from_args(&cli.serve)
        .unwrap_or_else(|e| panic!("kvroute rejects the manifest's args {args:?}: {e}"))
}

// ---------------------------------------------------------------------------------
// Every document

#[test]
fn every_manifest_document_parses_and_has_api_version_kind_and_name() {
    let docs = documents();
    assert!(docs.len() >= 15, "only {} documents", docs.len());
    let cluster_scoped = set(&["Namespace", "CustomResourceDefinition"]);
    let mut seen = BTreeSet::new();
    for doc in &docs {
        let at = doc.file.display();
        assert!(
            doc.value["apiVersion"]
                .as_str()
                .is_some_and(|v| !v.is_empty()),
            "{at}: a document without apiVersion"
        );
        assert!(!doc.kind().is_empty(), "{at}: a document without kind");
        assert!(
            !doc.name().is_empty(),
            "{at}: a {} without metadata.name",
            doc.kind()
        );
        let namespace = doc.value["metadata"]["namespace"].as_str();
        if cluster_scoped.contains(doc.kind()) {
            assert_eq!(namespace, None, "{at}: {} is cluster-scoped", doc.kind());
        } else {
            assert!(
                namespace.is_some_and(|n| !n.is_empty()),
                "{at}: {} {} has no namespace",
                doc.kind(),
                doc.name()
            );
        }
        assert!(
            seen.insert((doc.kind().to_owned(), namespace, doc.name().to_owned())),
            "{at}: {} {} is defined twice",
            doc.kind(),
            doc.name()
        );
    }
    let kinds: BTreeSet<String> = docs.iter().map(|d| d.kind().to_owned()).collect();
    for kind in [
        "CustomResourceDefinition",
        "Deployment",
        "Service",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "InferencePool",
        "EnvoyFilter",
        "ConfigMap",
        "ServiceMonitor",
        "PodMonitor",
    ] {
        assert!(kinds.contains(kind), "no {kind} in manifests/");
    }
}

#[test]
fn every_kustomization_lists_existing_resources_and_every_manifest_is_listed() {
    // Alternatives a user swaps in by hand.
    let optional = set(&["monitoring/podmonitor.yaml"]);
    let mut listed = BTreeSet::new();
    let mut kustomizations = 0;
    for path in yaml_files().into_iter().filter(|p| is_kustomization(p)) {
        kustomizations += 1;
        let dir = path.parent().expect("dir");
        let values = parse_yaml_documents(&path);
        assert_eq!(values.len(), 1, "{}", path.display());
        let k = &values[0];
        assert_eq!(
            k["apiVersion"],
            "kustomize.config.k8s.io/v1beta1",
            "{}",
            path.display()
        );
        assert_eq!(k["kind"], "Kustomization", "{}", path.display());
        for resource in strings(&k["resources"]) {
            let target = dir.join(&resource);
            if target.is_dir() {
                assert!(
                    target.join("kustomization.yaml").is_file(),
                    "{}: {resource} is a directory without kustomization.yaml",
                    path.display()
                );
            } else {
                assert!(
                    target.is_file(),
                    "{}: {resource} does not exist",
                    path.display()
                );
                listed.insert(target.canonicalize().expect("canonical path"));
            }
        }
    }
    assert!(kustomizations >= 8, "only {kustomizations} kustomizations");
    for file in yaml_files().into_iter().filter(|p| !is_kustomization(p)) {
        let relative = file
            .strip_prefix(manifests_dir())
            .expect("under manifests/")
            .to_string_lossy()
            .into_owned();
        if optional.contains(&relative) {
            continue;
        }
        assert!(
            listed.contains(&file.canonicalize().expect("canonical path")),
            "manifests/{relative} is in no kustomization"
        );
    }
}

// ---------------------------------------------------------------------------------
// The CRD and the example pool

#[test]
fn the_crd_is_the_inference_pool_v1_schema() {
    let docs = documents();
    let crd = find(
        &docs,
        "CustomResourceDefinition",
        "inferencepools.inference.networking.k8s.io",
    );
    assert_eq!(crd["apiVersion"], "apiextensions.k8s.io/v1");
    // Required for a CRD in a *.k8s.io group, or the API server rejects it.
    assert!(
        crd["metadata"]["annotations"]["api-approved.kubernetes.io"]
            .as_str()
            .is_some_and(|v| !v.is_empty())
    );
    let spec = &crd["spec"];
    assert_eq!(spec["group"], "inference.networking.k8s.io");
    assert_eq!(spec["scope"], "Namespaced");
    assert_eq!(spec["names"]["kind"], "InferencePool");
    assert_eq!(spec["names"]["plural"], "inferencepools");
    assert_eq!(spec["names"]["singular"], "inferencepool");
    assert_eq!(spec["names"]["listKind"], "InferencePoolList");

    let versions = spec["versions"].as_array().expect("versions");
    assert_eq!(versions.len(), 1);
    let v1 = &versions[0];
    assert_eq!(v1["name"], "v1");
    assert_eq!(v1["served"], true);
    assert_eq!(v1["storage"], true);
    assert!(
        v1["subresources"]["status"].is_object(),
        "status subresource"
    );

    let schema = &v1["schema"]["openAPIV3Schema"];
    assert_eq!(schema["type"], "object");
    assert_eq!(strings(&schema["required"]), ["spec"]);
    let pool = &schema["properties"]["spec"];
    assert_eq!(
        strings(&pool["required"])
            .into_iter()
            .collect::<BTreeSet<_>>(),
        set(&["selector", "targetPorts", "endpointPickerRef"])
    );
    let props = &pool["properties"];

    let selector = &props["selector"];
    assert_eq!(strings(&selector["required"]), ["matchLabels"]);
    let match_labels = &selector["properties"]["matchLabels"];
    assert_eq!(match_labels["type"], "object");
    assert_eq!(match_labels["additionalProperties"]["type"], "string");
    assert_eq!(match_labels["minProperties"], 1);

    let ports = &props["targetPorts"];
    assert_eq!(ports["type"], "array");
    assert_eq!(ports["minItems"], 1);
    assert_eq!(ports["maxItems"], 8);
    assert_eq!(
        ports["maxItems"].as_u64(),
        Some(kvroute::discovery::inference_pool::MAX_TARGET_PORTS as u64),
        "kvroute's limit and the CRD's agree"
    );
    assert_eq!(strings(&ports["items"]["required"]), ["number"]);
    let number = &ports["items"]["properties"]["number"];
    assert_eq!(number["type"], "integer");
    assert_eq!(number["format"], "int32");
    assert_eq!(number["minimum"], 1);
    assert_eq!(number["maximum"], 65535);

    let picker = &props["endpointPickerRef"];
    assert_eq!(picker["type"], "object");
    assert_eq!(strings(&picker["required"]), ["name"]);
    let picker_props = &picker["properties"];
    assert_eq!(picker_props["name"]["type"], "string");
    assert_eq!(picker_props["kind"]["default"], "Service");
    assert_eq!(strings(&picker_props["port"]["required"]), ["number"]);
    assert_eq!(
        picker_props["port"]["properties"]["number"]["type"],
        "integer"
    );
    assert_eq!(
        strings(&picker_props["failureMode"]["enum"]),
        ["FailOpen", "FailClose"]
    );
    assert_eq!(picker_props["failureMode"]["default"], "FailClose");

    let parents = &schema["properties"]["status"]["properties"]["parents"];
    assert_eq!(parents["type"], "array");
    assert_eq!(strings(&parents["items"]["required"]), ["parentRef"]);
    let conditions = &parents["items"]["properties"]["conditions"];
    assert_eq!(conditions["type"], "array");
    assert_eq!(strings(&conditions["x-kubernetes-list-map-keys"]), ["type"]);
}

#[test]
fn the_example_pool_selects_the_vllm_pods_and_names_kvroute_as_its_picker() {
    let docs = documents();
    let pool_value = find(&docs, "InferencePool", "vllm-llama3");
    assert_eq!(pool_value["apiVersion"], "inference.networking.k8s.io/v1");

    // kvroute's own typed resource reads it, and accepts it.
    let pool: InferencePool =
        serde_json::from_value(pool_value.clone()).expect("kvroute parses the pool");
    let target = pool.spec.pod_target().expect("kvroute accepts the pool");
    assert_eq!(target.selector().to_string(), "app=vllm-llama3");

    let vllm = find(&docs, "Deployment", "vllm-llama3");
    assert_eq!(
        vllm["metadata"]["namespace"],
        pool_value["metadata"]["namespace"]
    );
    let pod_labels = &vllm["spec"]["template"]["metadata"]["labels"];
    assert!(selects(
        &pool_value["spec"]["selector"]["matchLabels"],
        pod_labels
    ));
    let server = container(&vllm["spec"]["template"]["spec"], "vllm");
    let http = container_port(&server, "http");
    let ports: Vec<u64> = pool_value["spec"]["targetPorts"]
        .as_array()
        .expect("targetPorts")
        .iter()
        .map(|p| p["number"].as_u64().expect("number"))
        .collect();
    assert_eq!(ports, [http], "the pool targets the vLLM container's port");

    // The picker reference is kvroute's Service and its ext_proc port.
    let picker = &pool_value["spec"]["endpointPickerRef"];
    assert_eq!(picker["kind"], "Service");
    let service = find(&docs, "Service", picker["name"].as_str().expect("name"));
    assert_eq!(
        service["metadata"]["namespace"],
        pool_value["metadata"]["namespace"]
    );
    let grpc = service["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "grpc")
        .expect("grpc port")
        .clone();
    assert_eq!(picker["port"]["number"], grpc["port"]);
    assert!(
        ["FailOpen", "FailClose"].contains(&picker["failureMode"].as_str().unwrap_or_default())
    );
}

#[test]
fn the_example_vllm_deployment_serves_a_base_model_with_lora_adapters() {
    let docs = documents();
    let vllm = find(&docs, "Deployment", "vllm-llama3");
    let server = container(&vllm["spec"]["template"]["spec"], "vllm");
    let args = strings(&server["args"]);
    let has = |flag: &str| {
        args.iter()
            .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
    };
    for flag in ["--model", "--enable-lora", "--lora-modules", "--max-loras"] {
        assert!(has(flag), "vLLM args lack {flag}: {args:?}");
    }
    let modules: Vec<&String> = args
        .iter()
        .skip_while(|a| *a != "--lora-modules")
        .skip(1)
        .take_while(|a| !a.starts_with("--"))
        .collect();
    assert!(modules.len() >= 2, "at least two adapters: {modules:?}");
    for module in modules {
        let module: Value = serde_json::from_str(module).expect("adapter JSON");
        assert!(
            module["name"].is_string() && module["path"].is_string(),
            "{module}"
        );
    }
    assert!(server["resources"]["limits"]["nvidia.com/gpu"].is_string());
    assert_eq!(server["readinessProbe"]["httpGet"]["path"], "/health");
    let service = find(&docs, "Service", "vllm-llama3");
    assert!(selects(
        &service["spec"]["selector"],
        &vllm["spec"]["template"]["metadata"]["labels"]
    ));
}

// ---------------------------------------------------------------------------------
// kvroute's Deployment, Service and RBAC

#[test]
fn rbac_grants_only_get_list_watch_on_pods_and_inferencepools_in_its_namespace() {
    let docs = documents();
    for doc in &docs {
        assert!(
            !matches!(doc.kind(), "ClusterRole" | "ClusterRoleBinding"),
            "{}: kvroute needs no cluster-wide access",
            doc.file.display()
        );
    }
    let role = find(&docs, "Role", "kvroute");
    assert_eq!(role["metadata"]["namespace"], "llm");
    let rules = role["rules"].as_array().expect("rules");
    let mut granted = BTreeMap::new();
    for rule in rules {
        assert_eq!(
            strings(&rule["verbs"]),
            ["get", "list", "watch"],
            "verbs are exactly get/list/watch: {rule}"
        );
        assert!(rule.get("resourceNames").is_none() && rule.get("nonResourceURLs").is_none());
        for group in strings(&rule["apiGroups"]) {
            for resource in strings(&rule["resources"]) {
                assert!(
                    granted.insert((group.clone(), resource), ()).is_none(),
                    "duplicate grant"
                );
            }
        }
    }
    let granted: BTreeSet<(String, String)> = granted.into_keys().collect();
    assert_eq!(
        granted,
        BTreeSet::from([
            (String::new(), "pods".to_owned()),
            (
                "inference.networking.k8s.io".to_owned(),
                "inferencepools".to_owned()
            ),
        ])
    );

    let binding = find(&docs, "RoleBinding", "kvroute");
    assert_eq!(binding["metadata"]["namespace"], "llm");
    assert_eq!(binding["roleRef"]["kind"], "Role");
    assert_eq!(binding["roleRef"]["name"], "kvroute");
    assert_eq!(binding["roleRef"]["apiGroup"], "rbac.authorization.k8s.io");
    let subjects = binding["subjects"].as_array().expect("subjects");
    assert_eq!(subjects.len(), 1);
    assert_eq!(subjects[0]["kind"], "ServiceAccount");
    assert_eq!(subjects[0]["name"], "kvroute");
    assert_eq!(subjects[0]["namespace"], "llm");
    let account = find(&docs, "ServiceAccount", "kvroute");
    assert_eq!(account["metadata"]["namespace"], "llm");

    for deployment in ["kvroute", "kvroute-gateway"] {
        let d = find(&docs, "Deployment", deployment);
        assert_eq!(
            d["spec"]["template"]["spec"]["serviceAccountName"],
            "kvroute"
        );
        assert_eq!(d["metadata"]["namespace"], "llm");
    }
}

/// What every kvroute (and Envoy) container must carry.
fn assert_locked_down(container: &Value, pod_spec: &Value) {
    let name = &container["name"];
    let sc = &container["securityContext"];
    assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
    assert_eq!(sc["readOnlyRootFilesystem"], true, "{name}");
    assert_ne!(sc["privileged"], true, "{name}");
    assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"], "{name}");
    assert!(sc["capabilities"].get("add").is_none(), "{name}");
    let non_root =
        sc["runAsNonRoot"] == true || pod_spec["securityContext"]["runAsNonRoot"] == true;
    assert!(non_root, "{name} runs as non-root");
    let uid = sc["runAsUser"]
        .as_u64()
        .or(pod_spec["securityContext"]["runAsUser"].as_u64());
    assert!(uid.is_some_and(|uid| uid != 0), "{name} has a non-zero uid");
    for what in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(
                !container["resources"][what][resource].is_null(),
                "{name}: resources.{what}.{resource}"
            );
        }
    }
}

fn assert_grpc_probes(container: &Value) {
    let health = container_port(container, "grpc-health");
    assert_eq!(health, 9003);
    for (probe, service) in [
        ("livenessProbe", "liveness"),
        ("readinessProbe", "readiness"),
    ] {
        let grpc = &container[probe]["grpc"];
        assert_eq!(grpc["port"], 9003, "{probe} uses gRPC health on 9003");
        assert_eq!(grpc["service"], service, "{probe}");
        assert!(container[probe]["httpGet"].is_null() && container[probe]["exec"].is_null());
    }
}

#[test]
fn the_kvroute_deployment_probes_grpc_health_and_runs_locked_down() {
    let docs = documents();
    let deployment = find(&docs, "Deployment", "kvroute");
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let kvroute = container(pod, "kvroute");
    assert_grpc_probes(&kvroute);
    assert_locked_down(&kvroute, pod);
    assert_eq!(container_port(&kvroute, "grpc"), 9002);
    assert_eq!(container_port(&kvroute, "metrics"), 9090);
    assert!(
        deployment["spec"]["selector"]["matchLabels"]
            .as_object()
            .is_some_and(|labels| !labels.is_empty())
    );
    assert!(selects(
        &deployment["spec"]["selector"]["matchLabels"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));

    // kvroute's own parser accepts the arguments: Kubernetes discovery of the example
    // pool, the conventional ports.
    let config = kvroute_config(&kvroute);
    let kubernetes = config.kubernetes.expect("Kubernetes discovery");
    assert_eq!(
        kubernetes.target,
        kvroute::discovery::KubeTarget::Pool {
            name: "vllm-llama3".into()
        }
    );
    assert_eq!(config.grpc_addr.port(), 9002);
    assert_eq!(config.health_addr.map(|a| a.port()), Some(9003));
    assert_eq!(config.metrics_addr.port(), 9090);
    // The namespace comes from the pod itself.
    let env = kvroute["env"].as_array().expect("env");
    let namespace = env
        .iter()
        .find(|e| e["name"] == "KVROUTE_POOL_NAMESPACE")
        .expect("KVROUTE_POOL_NAMESPACE");
    assert_eq!(
        namespace["valueFrom"]["fieldRef"]["fieldPath"],
        "metadata.namespace"
    );
    // The kubelet must not kill kvroute before it drains.
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("grace");
    assert!(Duration::from_secs(grace) > config.drain_timeout);
}

#[test]
fn the_kvroute_service_exposes_grpc_as_h2c_health_and_metrics() {
    let docs = documents();
    let service = find(&docs, "Service", "kvroute");
    let deployment = find(&docs, "Deployment", "kvroute");
    assert!(selects(
        &service["spec"]["selector"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));
    let kvroute = container(&deployment["spec"]["template"]["spec"], "kvroute");
    let ports: BTreeMap<String, Value> = service["spec"]["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| (p["name"].as_str().expect("name").to_owned(), p.clone()))
        .collect();
    for (name, number) in [("grpc", 9002), ("grpc-health", 9003), ("metrics", 9090)] {
        let port = ports
            .get(name)
            .unwrap_or_else(|| panic!("Service port {name}"));
        assert_eq!(port["port"], number, "{name}");
        let target = &port["targetPort"];
        let target_number = target
            .as_u64()
            .unwrap_or_else(|| container_port(&kvroute, target.as_str().expect("targetPort")));
        assert_eq!(target_number, number, "{name} reaches the container port");
    }
    assert_eq!(ports["grpc"]["appProtocol"], "kubernetes.io/h2c");
}

// ---------------------------------------------------------------------------------
// Envoy: the Istio EnvoyFilter and the sidecar variant

/// Protobuf MERGE, as Istio applies it: objects merge field by field, lists append,
/// anything else is replaced.
fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(base), Value::Object(patch)) => {
            for (key, value) in patch {
                merge(base.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
        (Value::Array(base), Value::Array(patch)) => base.extend(patch.iter().cloned()),
        (base, patch) => *base = patch.clone(),
    }
}

fn envoy_filter() -> Value {
    find(&documents(), "EnvoyFilter", "kvroute-ext-proc")
}

/// The EnvoyFilter's patches of one kind, in order.
fn patches_of(filter: &Value, apply_to: &str) -> Vec<Value> {
    filter["spec"]["configPatches"]
        .as_array()
        .expect("configPatches")
        .iter()
        .filter(|p| p["applyTo"] == apply_to)
        .cloned()
        .collect()
}

/// The one HTTP_FILTER patch that inserts the filter `name`.
fn filter_patch(filter: &Value, name: &str) -> Value {
    let patches: Vec<Value> = patches_of(filter, "HTTP_FILTER")
        .into_iter()
        .filter(|p| p["patch"]["value"]["name"] == name)
        .collect();
    assert_eq!(patches.len(), 1, "one patch inserting {name}");
    patches[0].clone()
}

/// The one CLUSTER patch of the Service `service_prefix`.<namespace>.svc...
fn cluster_patch(filter: &Value, service_prefix: &str) -> Value {
    let patches: Vec<Value> = patches_of(filter, "CLUSTER")
        .into_iter()
        .filter(|p| {
            p["match"]["cluster"]["service"]
                .as_str()
                .is_some_and(|s| s.starts_with(&format!("{service_prefix}.")))
        })
        .collect();
    assert_eq!(patches.len(), 1, "one CLUSTER patch for {service_prefix}");
    patches[0].clone()
}

/// Istio's name for the outbound cluster of `service:port`.
fn istio_cluster(service: &str, port: u64) -> String {
    format!("outbound|{port}||{service}")
}

#[test]
fn the_istio_envoy_filter_inserts_full_duplex_ext_proc_and_honours_the_pick() {
    let docs = documents();
    let filter = envoy_filter();
    assert_eq!(filter["apiVersion"], "networking.istio.io/v1alpha3");
    assert!(
        filter["spec"]["workloadSelector"]["labels"]
            .as_object()
            .is_some_and(|labels| !labels.is_empty()),
        "applies to the ingress gateway only"
    );

    // The client's destination header is removed first, then the picker runs.
    let filters: Vec<Value> = patches_of(&filter, "HTTP_FILTER")
        .iter()
        .map(|p| p["patch"]["value"]["name"].clone())
        .collect();
    assert_eq!(
        filters,
        [
            "envoy.filters.http.header_mutation",
            "envoy.filters.http.ext_proc"
        ]
    );
    let strip = filter_patch(&filter, "envoy.filters.http.header_mutation");
    assert_eq!(
        strip["patch"]["value"]["typed_config"]["mutations"]["request_mutations"][0]["remove"],
        "x-gateway-destination-endpoint"
    );
    let http = filter_patch(&filter, "envoy.filters.http.ext_proc");
    assert_eq!(http["match"]["context"], "GATEWAY");
    assert_eq!(
        http["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
        "envoy.filters.http.router"
    );
    assert_eq!(http["patch"]["operation"], "INSERT_BEFORE");
    let ext_proc = &http["patch"]["value"];
    assert_eq!(ext_proc["name"], "envoy.filters.http.ext_proc");
    let config = &ext_proc["typed_config"];
    assert_eq!(
        config["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
    );
    let mode = &config["processing_mode"];
    assert_eq!(mode["request_body_mode"], "FULL_DUPLEX_STREAMED");
    assert_eq!(mode["response_body_mode"], "FULL_DUPLEX_STREAMED");
    assert_eq!(
        mode["request_trailer_mode"], "SEND",
        "full duplex needs trailers"
    );
    assert_eq!(mode["request_header_mode"], "SEND");
    assert_eq!(
        strings(&config["metadata_options"]["receiving_namespaces"]["untyped"]),
        ["envoy.lb"]
    );
    // The ext_proc cluster is kvroute's Service, port grpc.
    let service = find(&docs, "Service", "kvroute");
    let kvroute_host = format!(
        "kvroute.{}.svc.cluster.local",
        service["metadata"]["namespace"]
            .as_str()
            .expect("namespace")
    );
    assert_eq!(
        config["grpc_service"]["envoy_grpc"]["cluster_name"],
        istio_cluster(&kvroute_host, 9002)
    );

    assert_eq!(config["status_on_error"]["code"], "ServiceUnavailable");
    // kvroute's cluster: a frozen or draining picker leaves rotation.
    let picker = cluster_patch(&filter, "kvroute");
    assert_eq!(picker["match"]["cluster"]["portNumber"], 9002);
    let checks = &picker["patch"]["value"]["health_checks"][0];
    assert_eq!(
        checks["grpc_health_check"]["service_name"],
        "envoy.service.ext_proc.v3.ExternalProcessor"
    );
    assert_eq!(
        picker["patch"]["value"]["common_lb_config"]["healthy_panic_threshold"]["value"],
        0
    );

    let cluster = cluster_patch(&filter, "vllm-llama3");
    assert_eq!(cluster["match"]["context"], "GATEWAY");
    assert_eq!(cluster["patch"]["operation"], "MERGE");
    let vllm = find(&docs, "Service", "vllm-llama3");
    assert_eq!(
        cluster["match"]["cluster"]["service"],
        format!(
            "vllm-llama3.{}.svc.cluster.local",
            vllm["metadata"]["namespace"].as_str().expect("namespace")
        )
    );
    assert_eq!(
        cluster["match"]["cluster"]["portNumber"],
        vllm["spec"]["ports"][0]["port"]
    );
    let policy = &cluster["patch"]["value"]["load_balancing_policy"]["policies"][0]["typed_extension_config"];
    assert_eq!(
        policy["name"],
        "envoy.load_balancing_policies.override_host"
    );
    let sources = policy["typed_config"]["override_host_sources"]
        .as_array()
        .expect("sources");
    assert_eq!(sources[0]["metadata"]["key"], "envoy.lb");
    assert_eq!(
        sources[0]["metadata"]["path"][0]["key"],
        "x-gateway-destination-endpoint"
    );
    assert_eq!(sources[1]["header"], "x-gateway-destination-endpoint");
    assert_eq!(
        policy["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]["name"],
        "envoy.load_balancing_policies.round_robin"
    );
}

/// A bootstrap shaped like an Istio ingress gateway's: an HTTP listener whose filter
/// chain gets the EnvoyFilter's HTTP_FILTER patch, the model's cluster (as Istio builds
/// it, with round robin) with the CLUSTER patch merged in, and kvroute's cluster.
fn istio_gateway_bootstrap(filter: &Value) -> Value {
    let strip =
        filter_patch(filter, "envoy.filters.http.header_mutation")["patch"]["value"].clone();
    let http = filter_patch(filter, "envoy.filters.http.ext_proc");
    let picker_patch = cluster_patch(filter, "kvroute");
    let cluster_patch = cluster_patch(filter, "vllm-llama3");
    let ext_proc = http["patch"]["value"].clone();
    let ext_proc_cluster = ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        .as_str()
        .expect("ext_proc cluster")
        .to_owned();
    let model_cluster = istio_cluster(
        cluster_patch["match"]["cluster"]["service"]
            .as_str()
            .expect("service"),
        cluster_patch["match"]["cluster"]["portNumber"]
            .as_u64()
            .expect("port"),
    );

    let router = json!({
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        }
    });
    // Each INSERT_BEFORE the router, in order.
    let http_filters = json!([strip, ext_proc, router]);

    let mut model = json!({
        "name": model_cluster,
        "type": "STATIC",
        "connect_timeout": "10s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": model_cluster,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "10.0.0.11", "port_value": 8000}}}},
                {"endpoint": {"address": {"socket_address": {"address": "10.0.0.12", "port_value": 8000}}}}
            ]}]
        }
    });
    merge(&mut model, &cluster_patch["patch"]["value"]);
    let mut picker = json!({
        "name": ext_proc_cluster,
        "type": "STATIC",
        "connect_timeout": "10s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}
            }
        },
        "load_assignment": {
            "cluster_name": ext_proc_cluster,
            "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "10.0.0.2", "port_value": 9002}}}}
            ]}]
        }
    });
    merge(&mut picker, &picker_patch["patch"]["value"]);

    json!({
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {
            "listeners": [{
                "name": "0.0.0.0_8080",
                "address": {"socket_address": {"address": "0.0.0.0", "port_value": 8080}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "outbound_0.0.0.0_8080",
                        "route_config": {
                            "name": "http.8080",
                            "virtual_hosts": [{
                                "name": "*:80",
                                "domains": ["*"],
                                "routes": [{
                                    "match": {"prefix": "/v1/"},
                                    "route": {"cluster": model_cluster, "timeout": "0s"}
                                }]
                            }]
                        },
                        "http_filters": http_filters
                    }
                }]}]
            }],
            "clusters": [
                model,
                picker
            ]
        }
    })
}

#[test]
fn the_istio_envoy_filter_patches_pass_envoy_validation_in_a_gateway_bootstrap() {
    let filter = envoy_filter();
    let bootstrap = istio_gateway_bootstrap(&filter);
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("istio-gateway.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&bootstrap).expect("json"),
    )
    .expect("write");
    envoy_validate_file(&path);
}

#[test]
fn the_sidecar_envoy_config_is_the_shipped_gateway_config_and_is_valid() {
    let docs = documents();
    let config_map = find(&docs, "ConfigMap", "kvroute-gateway-envoy");
    let text = config_map["data"]["envoy.yaml"]
        .as_str()
        .expect("data envoy.yaml");
    let embedded: Value = serde_norway::from_str(text).expect("embedded Envoy config parses");
    let shipped = parse_yaml_documents(&project_file("envoy/gateway-original-dst.yaml"));
    assert_eq!(
        embedded, shipped[0],
        "the ConfigMap drifted from envoy/gateway-original-dst.yaml"
    );
    let listener = &embedded["static_resources"]["listeners"][0];
    assert_eq!(listener["address"]["socket_address"]["port_value"], 8080);
    let kvroute_cluster = embedded["static_resources"]["clusters"]
        .as_array()
        .expect("clusters")
        .iter()
        .find(|c| c["name"] == "kvroute")
        .expect("kvroute cluster")
        .clone();
    let address = &kvroute_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        ["address"]["socket_address"];
    assert_eq!(address["address"], "127.0.0.1");
    assert_eq!(address["port_value"], 9002);

    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("envoy.yaml");
    std::fs::write(&path, text).expect("write");
    envoy_validate_file(&path);

    // The pod: Envoy reads that ConfigMap; kvroute listens where Envoy looks for it.
    let deployment = find(&docs, "Deployment", "kvroute-gateway");
    let pod = &deployment["spec"]["template"]["spec"];
    let envoy = container(pod, "envoy");
    assert_eq!(container_port(&envoy, "http"), 8080);
    let mount = envoy["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["name"] == "envoy-config")
        .expect("envoy-config mount")
        .clone();
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "envoy-config")
        .expect("envoy-config volume")
        .clone();
    assert_eq!(volume["configMap"]["name"], "kvroute-gateway-envoy");
    let config_path = format!("{}/envoy.yaml", mount["mountPath"].as_str().expect("path"));
    let args = strings(&envoy["args"]);
    let at = args
        .iter()
        .position(|a| a == "--config-path")
        .expect("--config-path");
    assert_eq!(
        args.get(at + 1),
        Some(&config_path),
        "Envoy reads {config_path}"
    );
    // Envoy accepts the container's own arguments, with the ConfigMap's file.
    let mut local_args = args.clone();
    local_args[at + 1] = path.display().to_string();
    local_args.retain(|a| a != "--disable-hot-restart");
    envoy_validate(&local_args);
    assert_locked_down(&envoy, pod);

    let kvroute = container(pod, "kvroute");
    assert_grpc_probes(&kvroute);
    assert_locked_down(&kvroute, pod);
    let config = kvroute_config(&kvroute);
    assert_eq!(config.grpc_addr, SocketAddr::from(([127, 0, 0, 1], 9002)));
    assert_eq!(container_port(&kvroute, "metrics"), 9090);

    let service = find(&docs, "Service", "kvroute-gateway");
    assert!(selects(
        &service["spec"]["selector"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));
    // The two variants' Services do not select each other's pods.
    let standalone = find(&docs, "Service", "kvroute");
    assert!(!selects(
        &standalone["spec"]["selector"],
        &deployment["spec"]["template"]["metadata"]["labels"]
    ));
}

// ---------------------------------------------------------------------------------
// Monitoring

#[test]
fn the_service_and_pod_monitors_scrape_kvroutes_metrics_port() {
    let docs = documents();
    let monitor = find(&docs, "ServiceMonitor", "kvroute");
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    for service in ["kvroute", "kvroute-gateway"] {
        let service = find(&docs, "Service", service);
        assert!(
            selects(
                &monitor["spec"]["selector"]["matchLabels"],
                &service["metadata"]["labels"]
            ),
            "the ServiceMonitor selects {}",
            service["metadata"]["name"]
        );
        assert!(
            service["spec"]["ports"]
                .as_array()
                .expect("ports")
                .iter()
                .any(|p| p["name"] == "metrics")
        );
    }
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["port"], "metrics");
    assert_eq!(endpoint["path"], "/metrics");

    let pod_monitor = find(&docs, "PodMonitor", "kvroute");
    assert_eq!(pod_monitor["apiVersion"], "monitoring.coreos.com/v1");
    let endpoint = &pod_monitor["spec"]["podMetricsEndpoints"][0];
    assert_eq!(endpoint["port"], "metrics");
    assert_eq!(endpoint["path"], "/metrics");
    for deployment in ["kvroute", "kvroute-gateway"] {
        let d = find(&docs, "Deployment", deployment);
        assert!(selects(
            &pod_monitor["spec"]["selector"]["matchLabels"],
            &d["spec"]["template"]["metadata"]["labels"]
        ));
        assert_eq!(
            container_port(
                &container(&d["spec"]["template"]["spec"], "kvroute"),
                "metrics"
            ),
            9090
        );
    }
}

// ---------------------------------------------------------------------------------
// The Grafana dashboard

fn dashboard() -> Value {
    let path = manifests_dir().join("grafana/kvroute-dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every PromQL expression of the dashboard, with the panel's title.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    fn collect(panels: &Value, out: &mut Vec<(String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or_default();
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push((title.to_owned(), expr.to_owned()));
                }
            }
            collect(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    collect(&dashboard["panels"], &mut out);
    out
}

/// Replaces Grafana's built-in interval variables with values for a short test.
fn with_test_intervals(expr: &str) -> String {
    let expr = expr
        .replace("$__rate_interval", "1m")
        .replace("$__interval", "1s")
        .replace("$__range", "1m");
    assert!(
        !expr.contains('$'),
        "the dashboard uses a template variable the test cannot fill: {expr}"
    );
    expr
}

/// The metric names a PromQL expression mentions (identifiers outside string literals
/// that start with `kvroute_`).
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut in_string: Option<char> = None;
    let mut current = String::new();
    let flush = |current: &mut String, names: &mut BTreeSet<String>| {
        if current.starts_with("kvroute_") {
            names.insert(current.clone());
        }
        current.clear();
    };
    for c in expr.chars() {
        if let Some(quote) = in_string {
            if c == quote {
                in_string = None;
            }
            continue;
        }
        if c == '"' || c == '\'' || c == '`' {
            flush(&mut current, &mut names);
            in_string = Some(c);
        } else if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            current.push(c);
        } else {
            flush(&mut current, &mut names);
        }
    }
    flush(&mut current, &mut names);
    names
}

/// kvroute's metrics as src/telemetry.rs defines them: name → whether a histogram.
fn telemetry_metrics() -> BTreeMap<String, bool> {
    let source = std::fs::read_to_string(project_file("src/telemetry.rs")).expect("telemetry.rs");
    let mut constants = BTreeMap::new();
    for line in source.lines() {
        let line = line.trim();
        let Some(rest) = line.strip_prefix("pub const ") else {
            continue;
        };
        let Some((name, value)) = rest.split_once(": &str = \"") else {
            continue;
        };
        let value = value.trim_end_matches("\";");
        if value.starts_with("kvroute_") {
            constants.insert(name.trim().to_owned(), value.to_owned());
        }
    }
    assert!(
        constants.len() >= 10,
        "found only {constants:?} in telemetry.rs"
    );
    let histograms: BTreeSet<String> = source
        .split("describe_histogram!(")
        .skip(1)
        .map(|rest| {
            rest.trim_start()
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect();
    constants
        .into_iter()
        .map(|(constant, name)| (name, histograms.contains(&constant)))
        .collect()
}

/// The family a series name belongs to, if kvroute defines it.
fn family<'a>(series: &str, defined: &'a BTreeMap<String, bool>) -> Option<&'a str> {
    if let Some((name, _)) = defined.get_key_value(series) {
        return Some(name);
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
        let base = series.strip_suffix(suffix)?;
        match defined.get_key_value(base) {
            Some((name, true)) => Some(name.as_str()),
            _ => None,
        }
    })
}

#[test]
fn the_grafana_config_map_carries_the_dashboard_with_the_sidecar_label() {
    let docs = documents();
    let config_map = find(&docs, "ConfigMap", "kvroute-dashboard");
    assert_eq!(config_map["metadata"]["labels"]["grafana_dashboard"], "1");
    let data = config_map["data"].as_object().expect("data");
    assert_eq!(data.len(), 1);
    let (key, text) = data.iter().next().expect("one key");
    assert!(key.ends_with(".json"), "{key}");
    let embedded: Value = serde_json::from_str(text.as_str().expect("text")).expect("JSON");
    assert_eq!(
        embedded,
        dashboard(),
        "the ConfigMap drifted from grafana/kvroute-dashboard.json"
    );
}

#[test]
fn the_dashboard_names_only_metrics_kvroute_defines_and_shows_them_all() {
    let dashboard = dashboard();
    assert!(dashboard["title"].is_string() && dashboard["uid"].is_string());
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 15, "only {} queries", queries.len());
    let defined = telemetry_metrics();
    let mut shown = BTreeSet::new();
    for (title, expr) in &queries {
        let names = metric_names(expr);
        assert!(
            !names.is_empty(),
            "{title}: `{expr}` names no kvroute metric"
        );
        for name in names {
            let family = family(&name, &defined).unwrap_or_else(|| {
                panic!(
                    "{title}: `{expr}` uses {name}, which src/telemetry.rs does not define \
                     (defined: {:?})",
                    defined.keys()
                )
            });
            shown.insert(family.to_owned());
        }
    }
    let missing: Vec<&String> = defined.keys().filter(|m| !shown.contains(*m)).collect();
    assert!(missing.is_empty(), "no panel shows {missing:?}");
}

#[test]
fn the_metric_name_parser_skips_label_values_and_keeps_histogram_series() {
    let names = metric_names(
        r#"sum by (reason) (rate(kvroute_decisions_total{reason=~"kvroute_x.*"}[1m])) / histogram_quantile(0.9, rate(kvroute_pick_duration_seconds_bucket[1m]))"#,
    );
    assert_eq!(
        names,
        set(&[
            "kvroute_decisions_total",
            "kvroute_pick_duration_seconds_bucket"
        ])
    );
    let defined = BTreeMap::from([
        ("kvroute_pick_duration_seconds".to_owned(), true),
        ("kvroute_endpoints".to_owned(), false),
    ]);
    assert_eq!(
        family("kvroute_pick_duration_seconds_bucket", &defined),
        Some("kvroute_pick_duration_seconds")
    );
    assert_eq!(family("kvroute_endpoints_count", &defined), None);
}

// ---------------------------------------------------------------------------------
// A real Prometheus

/// A Prometheus server on loopback scraping one target, killed on drop.
struct Prometheus {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

fn prometheus_binary() -> PathBuf {
    std::env::var_os("PROMETHEUS_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/prometheus"))
}

impl Prometheus {
    fn start(target: SocketAddr) -> Prometheus {
        let binary = prometheus_binary();
        assert!(
            binary.is_file(),
            "no Prometheus at {} (apt-get install prometheus, or set PROMETHEUS_BIN)",
            binary.display()
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: kvroute\n    static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .expect("write config");
        let port = kvroute_lab::envoy::free_port().expect("free port");
        let log = dir.path().join("prometheus.log");
        let log_file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(&binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().expect("log"))
            .stderr(log_file)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        Prometheus {
            child,
            url: format!("http://127.0.0.1:{port}"),
            _dir: dir,
            log,
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Evaluates an instant query; returns the result vector.
    async fn query(&self, client: &reqwest::Client, expr: &str) -> Result<Vec<Value>, String> {
        let response = client
            .get(format!("{}/api/v1/query", self.url))
            .query(&[("query", expr)])
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = response.status();
        let body: Value = response.json().await.map_err(|e| e.to_string())?;
        if !status.is_success() || body["status"] != "success" {
            return Err(format!("{status}: {body}"));
        }
        Ok(body["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Waits (bounded) until Prometheus has scraped its target `scrapes` times
    /// successfully within the last minute.
    async fn wait_for_scrapes(&self, client: &reqwest::Client, scrapes: u32) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::from("no answer");
        while Instant::now() < deadline {
            match self
                .query(client, "sum_over_time(up{job=\"kvroute\"}[1m])")
                .await
            {
                Ok(result) => {
                    let value = result
                        .first()
                        .and_then(|r| r["value"][1].as_str())
                        .and_then(|v| v.parse::<f64>().ok())
                        .unwrap_or(0.0);
                    if value >= f64::from(scrapes) {
                        return;
                    }
                    last = format!("{value} successful scrapes");
                }
                Err(error) => last = error,
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        panic!(
            "Prometheus did not scrape kvroute {scrapes} times within 60 s ({last}):\n{}",
            self.log()
        );
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const MODEL: &str = "llama";
/// The model of the dashboard test's full pod.
const FULL_MODEL: &str = "mistral";
/// Served by the simulated pod that publishes KV events.
const EVENTS_MODEL: &str = "qwen";

/// POSTs `body` (raw) to Envoy; returns the status.
async fn post(client: &reqwest::Client, url: &str, body: String) -> u16 {
    client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

/// One round of the traffic the dashboard should show: base-model and adapter requests
/// (streamed and not), plus the errors kvroute answers itself.
async fn traffic_round(
    client: &reqwest::Client,
    url: &str,
) -> Vec<(&'static str, u16, &'static [u16])> {
    let mut outcomes = Vec::new();
    let requests: [(&str, Value, &[u16]); 8] = [
        (
            "base model",
            json!({"model": MODEL, "prompt": "hello", "max_tokens": 8}),
            &[200],
        ),
        (
            "base model, streamed",
            json!({"model": MODEL, "prompt": "hello", "max_tokens": 8, "stream": true}),
            &[200],
        ),
        (
            "running adapter",
            json!({"model": "sql-lora", "prompt": "select", "max_tokens": 8}),
            &[200],
        ),
        (
            "other adapter",
            json!({"model": "chat-lora", "prompt": "hi", "max_tokens": 8}),
            &[200],
        ),
        (
            "unknown model",
            json!({"model": "no-such-model", "prompt": "hi"}),
            // Every endpoint listed its models, the one that is down included: no pod
            // serves it.
            &[404],
        ),
        ("no model", json!({"prompt": "hi"}), &[400]),
        (
            "a model whose pod publishes KV events (its prompt is tokenized on the pod)",
            json!({"model": EVENTS_MODEL, "prompt": "a prompt long enough to fill a few blocks of sixteen tokens each, and then some more words", "max_tokens": 4}),
            &[200],
        ),
        (
            "a model whose pods have no room",
            // More KV than the full pod has free.
            json!({"model": FULL_MODEL, "prompt": "hi", "max_tokens": 4000}),
            // It waits --max-queue-wait, then 429.
            &[429],
        ),
    ];
    for (what, body, expected) in requests {
        outcomes.push((what, post(client, url, body.to_string()).await, expected));
    }
    outcomes.push((
        "malformed JSON",
        post(client, url, "{not json".into()).await,
        &[400],
    ));
    outcomes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_from_a_real_prometheus_scraping_kvroute() {
    // A small fleet: two live pods with LoRA adapters, one whose /metrics fails (so
    // scrape errors and unhealthy endpoints exist too).
    let pods = [
        FakePod::start("pod-0", MODEL, &["sql-lora", "chat-lora"]).await,
        FakePod::start("pod-1", MODEL, &["sql-lora", "chat-lora"]).await,
    ];
    pods[0].set_metrics(FakeMetrics {
        kv_usage: 0.2,
        running: 1,
        running_adapters: vec!["sql-lora".into()],
        ..FakeMetrics::default()
    });
    pods[1].set_metrics(FakeMetrics {
        kv_usage: 0.4,
        waiting: 1,
        running: 2,
        ..FakeMetrics::default()
    });
    let failing = FakePod::start("pod-2", MODEL, &[]).await;
    failing.override_metrics(Some((500, "engine dead")));
    let down = failing.addr;
    // A pod of another model with no room: its requests wait, then are dropped (flow
    // control's series).
    let full = FakePod::start("pod-3", FULL_MODEL, &[]).await;
    full.set_metrics(FakeMetrics {
        kv_usage: 0.97,
        ..FakeMetrics::default()
    });
    // A simulated pod publishing its KV events, followed by kvroute (the event panels),
    // both tokenizing with the lab's test tokenizer (the local tokenizer's panel).
    let tokenizer =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("crates/lab/tokenizers/bpe-4k");
    let (events_config, templates) =
        kvroute_lab::compare::with_kv_events(kvroute_sim::FleetConfig {
            model: EVENTS_MODEL.into(),
            speedup: 20.0,
            tokenizer: Some(tokenizer.clone()),
            ..kvroute_sim::FleetConfig::uniform(1, kvroute_sim::PodConfig::default())
        })
        .expect("ports for the events");
    let events_fleet = kvroute_sim::SimFleet::start(events_config)
        .await
        .expect("the simulated pod starts");
    let mut live: Vec<SocketAddr> = pods.iter().map(|p| p.addr).collect();
    live.push(full.addr);
    live.extend(events_fleet.endpoints());
    let mut endpoints = live.clone();
    endpoints.push(down);
    // As the binary does: jemalloc's counters feed the memory gauges.
    kvroute::telemetry::register_allocator_stats(kvroute::telemetry::jemalloc_stats);
    let mut config = test_config(endpoints);
    config.flow.max_wait = Duration::from_millis(100);
    config.prefix_source = kvroute::kvevents::PrefixSource::Auto;
    config.kv_events.endpoint =
        kvroute::kvevents::EndpointTemplate::parse(&templates.endpoint).expect("template");
    config.kv_events.replay_endpoint =
        Some(kvroute::kvevents::EndpointTemplate::parse(&templates.replay).expect("template"));
    config.tokenizers = vec![kvroute::tokenize::TokenizerSpec {
        model: Some(EVENTS_MODEL.into()),
        dir: tokenizer,
    }];
    let kvroute = Kvroute::start(config).await;
    kvroute
        .wait_for(
            "the live pods scraped, the failing one listed and down",
            |s| {
                live.iter().all(|addr| {
                    s.pod(*addr)
                        .is_some_and(|p| p.healthy && p.metrics().is_some() && p.models.is_some())
                }) && s
                    .pod(down)
                    .is_some_and(|p| !p.healthy && p.models.is_some())
            },
        )
        .await;
    let envoy = Envoy::start(Gateway::OriginalDst, kvroute.addrs.grpc, &live).await;
    let url = envoy.url("/v1/completions");
    let client = http_client();

    // Traffic before Prometheus starts (every series exists at its first scrape) and
    // while it scrapes (so rates and quantiles are not zero).
    for (what, status, expected) in traffic_round(&client, &url).await {
        assert!(
            expected.contains(&status),
            "{what}: {status}, expected {expected:?}\n{}",
            envoy.log()
        );
    }
    let (stop, mut stopped) = tokio::sync::watch::channel(false);
    let background = tokio::spawn({
        let client = client.clone();
        let url = url.clone();
        async move {
            while !*stopped.borrow() {
                traffic_round(&client, &url).await;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    _ = stopped.changed() => {}
                }
            }
        }
    });

    let prometheus = Prometheus::start(kvroute.addrs.metrics);
    prometheus.wait_for_scrapes(&client, 4).await;
    let _ = stop.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(10), background).await;

    // The metric families kvroute actually exposes.
    let exposition = kvroute.metrics_text().await;
    let exposed: BTreeSet<String> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();

    let queries = dashboard_queries(&dashboard());
    assert!(!queries.is_empty());
    let mut failures = Vec::new();
    for (title, expr) in &queries {
        for name in metric_names(expr) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| exposed.contains(*b)))
                .unwrap_or(&name);
            if !exposed.contains(base) {
                failures.push(format!("{title}: kvroute does not expose {name}"));
            }
        }
        let promql = with_test_intervals(expr);
        match prometheus.query(&client, &promql).await {
            Err(error) => failures.push(format!("{title}: `{promql}` failed: {error}")),
            Ok(result) if result.is_empty() => {
                failures.push(format!("{title}: `{promql}` returned no data"));
            }
            Ok(result) => {
                let finite = result.iter().any(|r| {
                    r["value"][1]
                        .as_str()
                        .and_then(|v| v.parse::<f64>().ok())
                        .is_some_and(f64::is_finite)
                });
                if !finite {
                    failures.push(format!(
                        "{title}: `{promql}` returned only NaN/Inf: {result:?}"
                    ));
                }
            }
        }
    }
    events_fleet.shutdown().await;
    assert!(
        failures.is_empty(),
        "{} of {} dashboard queries failed:\n{}\n\nkvroute exposes: {exposed:?}",
        failures.len(),
        queries.len(),
        failures.join("\n")
    );
}

#[test]
fn the_istio_route_admits_exactly_the_paths_kvroute_routes_by_default() {
    let route = find(&documents(), "VirtualService", "vllm-llama3");
    let admitted: Vec<&str> = route["spec"]["http"][0]["match"]
        .as_array()
        .expect("matches")
        .iter()
        .map(|m| m["uri"]["exact"].as_str().expect("exact paths only"))
        .collect();
    assert_eq!(
        admitted,
        kvroute::extproc::policy::DEFAULT_ALLOWED_PATHS,
        "a pod's management API must stay out of reach"
    );
}
