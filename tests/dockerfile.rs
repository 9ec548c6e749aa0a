//! The `Dockerfile` builds the image the manifests run: same image name, a non-root user
//! matching the pods' security context, the gateway binary as entrypoint, and every port
//! the kvroute containers declare exposed. When a Docker engine is present (not on the
//! development machine or CI here: no registry can be reached), it is built too.

// A test or benchmark that cannot set up is a failure: unwrap and expect are its asserts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Command;

use serde_json::Value;

fn project_file(relative: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The instructions of the Dockerfile's last stage (the runtime image), continuation
/// lines joined.
fn runtime_stage(dockerfile: &str) -> Vec<(String, String)> {
    let joined = dockerfile.replace("\\\n", " ");
    let last = joined.rsplit("\nFROM ").next().expect("a stage");
    last.lines()
        .skip(1) // the image the stage starts from
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| match line.split_once(' ') {
            Some((op, rest)) => (op.to_owned(), rest.trim().to_owned()),
            None => (line.to_owned(), String::new()),
        })
        .collect()
}

/// The kvroute container of a Deployment manifest.
fn kvroute_container(manifest: &str) -> (Value, Value) {
    let deployment: Value = serde_norway::from_str(manifest).expect("manifest parses");
    let spec = &deployment["spec"]["template"]["spec"];
    let container = spec["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == "kvroute")
        .expect("a kvroute container")
        .clone();
    (spec["securityContext"].clone(), container)
}

#[test]
fn the_image_runs_the_gateway_as_the_manifests_expect() {
    let dockerfile = project_file("Dockerfile");
    assert!(
        dockerfile.contains("cargo build --release --locked -p kvroute "),
        "the image builds only the gateway crate"
    );
    let runtime = runtime_stage(&dockerfile);
    let get = |op: &str| -> Vec<&str> {
        runtime
            .iter()
            .filter(|(o, _)| o == op)
            .map(|(_, rest)| rest.as_str())
            .collect()
    };
    assert_eq!(get("ENTRYPOINT"), [r#"["/usr/local/bin/kvroute"]"#]);
    let exposed: Vec<u64> = get("EXPOSE")
        .iter()
        .flat_map(|ports| ports.split_whitespace())
        .map(|port| port.parse().expect("numeric port"))
        .collect();
    let user = get("USER");
    assert_eq!(user.len(), 1, "one USER in the runtime stage");
    let (uid, gid) = user[0].split_once(':').expect("USER uid:gid");

    for manifest in [
        "manifests/kvroute/deployment.yaml",
        "manifests/sidecar/deployment.yaml",
    ] {
        let (security, container) = kvroute_container(&project_file(manifest));
        let image = container["image"].as_str().expect("image");
        assert!(
            dockerfile.contains(&format!("docker build -t {image} .")),
            "{manifest} runs {image}, which the Dockerfile's build command must name"
        );
        assert_eq!(container["args"][0], "serve", "{manifest}");
        assert_eq!(security["runAsNonRoot"], true, "{manifest}");
        assert_eq!(security["runAsUser"].to_string(), uid, "{manifest}");
        assert_eq!(security["runAsGroup"].to_string(), gid, "{manifest}");
        for port in container["ports"].as_array().expect("ports") {
            let port = port["containerPort"].as_u64().expect("containerPort");
            assert!(
                exposed.contains(&port),
                "{manifest}: port {port} not exposed"
            );
        }
    }
}

#[test]
fn the_image_builds_where_a_docker_engine_runs() {
    let engine = Command::new("docker")
        .args(["info", "--format", "{{.ServerVersion}}"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !engine {
        eprintln!("no Docker engine here: the image build is left to a machine with one");
        return;
    }
    let status = Command::new("docker")
        .args(["build", "--quiet", "-t", "kvroute:test", "."])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run docker build");
    assert!(status.success(), "docker build failed");
}
