//! Running a real Envoy in front of a fleet, for the demo, the benchmarks and the
//! end-to-end tests: the shipped configurations (embedded from `envoy/`) rewritten for
//! local ports, plus a plain round-robin gateway to compare against.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The fail-closed gateway (ORIGINAL_DST + header), as shipped.
pub const ORIGINAL_DST_CONFIG: &str = include_str!("../../../envoy/gateway-original-dst.yaml");
/// The fail-open gateway (override_host with round-robin fallback), as shipped.
pub const OVERRIDE_HOST_CONFIG: &str = include_str!("../../../envoy/gateway-override-host.yaml");

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("cannot start Envoy ({binary}): {source}; run scripts/setup or set ENVOY_BIN")]
    Spawn {
        binary: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write the Envoy config: {0}")]
    Write(#[from] std::io::Error),
    #[error("Envoy did not become ready within {0:?}:\n{1}")]
    NotReady(Duration, String),
}

/// The start of the kvroute cluster in the shipped configs.
const KVROUTE_CLUSTER_HEAD: &str =
    "    - name: kvroute\n      type: STATIC\n      connect_timeout: 1s\n";

/// The start of the pods' cluster in the fail-closed config.
const PODS_CLUSTER_HEAD: &str = "    - name: inference_pods\n      type: ORIGINAL_DST\n      lb_policy: CLUSTER_PROVIDED\n      connect_timeout: 2s\n";

/// What the pods' cluster of a shipped gateway needs to reach pods that speak HTTPS
/// (README, "TLS"): TLS trusting the pods' CA bundle, the one kvroute's `--pod-ca-bundle`
/// names. Envoy checks the chain; kvroute also checks that the certificate names the
/// pod's IP.
pub const PODS_TLS_TRANSPORT_SOCKET: &str = "      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          common_tls_context:
            validation_context:
              trusted_ca: { filename: /etc/kvroute-gateway/pod-ca.pem }
";

/// What the kvroute cluster of a shipped gateway needs to reach a kvroute started with
/// `--grpc-tls-cert/--grpc-tls-key/--grpc-tls-client-ca` (README, "TLS"): HTTP/2 over TLS,
/// the gateway's client certificate, kvroute's CA.
pub const KVROUTE_TLS_TRANSPORT_SOCKET: &str = "      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          \"@type\": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          common_tls_context:
            alpn_protocols: [h2]
            tls_certificates:
              - certificate_chain: { filename: /etc/kvroute-gateway/gateway.pem }
                private_key: { filename: /etc/kvroute-gateway/gateway-key.pem }
            validation_context:
              trusted_ca: { filename: /etc/kvroute-gateway/ca.pem }
";

/// Which gateway to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gateway {
    /// kvroute picks; ORIGINAL_DST routes to its header; fails closed.
    OriginalDst { kvroute: SocketAddr },
    /// The fail-closed gateway reaching pods that speak HTTPS (vLLM's `--ssl-certfile`),
    /// trusting the CAs in the PEM bundle at `pod_ca` ([`PODS_TLS_TRANSPORT_SOCKET`]).
    OriginalDstToHttpsPods {
        kvroute: SocketAddr,
        pod_ca: &'static str,
    },
    /// kvroute picks; override_host honours it, round robin without it; fails open.
    OverrideHost { kvroute: SocketAddr },
    /// The fail-closed gateway with another `request_body_mode` (tests of how kvroute
    /// answers modes it cannot route in).
    OriginalDstWithRequestBodyMode {
        kvroute: SocketAddr,
        mode: &'static str,
    },
    /// The fail-closed gateway reaching kvroute over mutual TLS: `certs` is a directory
    /// holding `ca.pem` (signs kvroute's certificate), `gateway.pem` and
    /// `gateway-key.pem` (the gateway's client certificate).
    OriginalDstOverTls {
        kvroute: SocketAddr,
        certs: &'static str,
    },
    /// The fail-closed gateway with two kvroute replicas in its processor cluster (Envoy
    /// spreads the ext_proc streams over both, health checks each).
    /// `observed`: with the response observer turned on.
    OriginalDstReplicas {
        kvroutes: [SocketAddr; 2],
        observed: bool,
    },
    /// The fail-closed gateway with its response observer turned on (the commented-out
    /// second ext_proc filter: kvroute checks each prediction against the response).
    OriginalDstObserved { kvroute: SocketAddr },
    /// The fail-open gateway with its response observer turned on.
    OverrideHostObserved { kvroute: SocketAddr },
    /// No picker: Envoy's own ROUND_ROBIN over the pods.
    RoundRobin,
    /// No picker: Envoy's own LEAST_REQUEST over the pods.
    LeastRequest,
}

/// A shipped config with the block between `# BEGIN observer` and `# END observer`
/// uncommented, as an operator turns the response observer on.
pub fn with_observer(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut inside = false;
    let mut seen = false;
    for line in template.lines() {
        match line.trim() {
            "# BEGIN observer" => (inside, seen) = (true, true),
            "# END observer" => inside = false,
            _ if inside => {
                // `# - name` becomes `- name`, at the comment's own indentation.
                let indent = line.len() - line.trim_start().len();
                let text = line.trim_start();
                let text = text.strip_prefix("# ").or_else(|| text.strip_prefix('#'));
                out.push_str(&line[..indent]);
                out.push_str(text.unwrap_or(line.trim_start()));
                out.push('\n');
            }
            _ => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    assert!(
        seen,
        "the shipped gateway lost its observer block: update this rewrite"
    );
    out
}

/// Rewrites a shipped config for local use: listener, admin and kvroute ports, and the
/// pod list between the `# BEGIN pods` / `# END pods` markers.
pub fn rewrite_shipped(
    template: &str,
    listener: u16,
    admin: u16,
    kvroute: SocketAddr,
    pods: &[SocketAddr],
) -> String {
    let mut out = String::with_capacity(template.len() + pods.len() * 100);
    let mut in_pods = false;
    for line in template.lines() {
        match line.trim() {
            "# BEGIN pods" => {
                in_pods = true;
                out.push_str(line);
                out.push('\n');
                for pod in pods {
                    out.push_str(&format!(
                        "              - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
                        pod.ip(),
                        pod.port()
                    ));
                }
                continue;
            }
            "# END pods" => in_pods = false,
            _ if in_pods => continue,
            _ => {}
        }
        let line = line
            .replace(
                "address: 0.0.0.0, port_value: 8080",
                &format!("address: 127.0.0.1, port_value: {listener}"),
            )
            .replace("port_value: 9901", &format!("port_value: {admin}"))
            .replace(
                "address: 127.0.0.1, port_value: 9002",
                &format!("address: {}, port_value: {}", kvroute.ip(), kvroute.port()),
            );
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// A gateway without a picker, balancing over `pods` with Envoy's `lb_policy`.
fn plain_config(listener: u16, admin: u16, lb_policy: &str, pods: &[SocketAddr]) -> String {
    let endpoints: String = pods
        .iter()
        .map(|pod| {
            format!(
                "          - endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}\n",
                pod.ip(),
                pod.port()
            )
        })
        .collect();
    format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
  - name: inference_gateway
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listener} }} }}
    per_connection_buffer_limit_bytes: 33554432
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: inference_gateway
          stream_idle_timeout: 300s
          route_config:
            virtual_hosts:
            - name: inference
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
                route: {{ cluster: inference_pods, timeout: 0s }}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: inference_pods
    type: STATIC
    connect_timeout: 2s
    lb_policy: {lb_policy}
    load_assignment:
      cluster_name: inference_pods
      endpoints:
      - lb_endpoints:
{endpoints}"#
    )
}

/// The Envoy binary: `$ENVOY_BIN`, else `.venv/bin/envoy` under the current directory,
/// else `envoy` on PATH.
pub fn envoy_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("ENVOY_BIN") {
        return PathBuf::from(path);
    }
    let venv = Path::new(".venv/bin/envoy");
    if venv.exists() {
        return venv.to_path_buf();
    }
    PathBuf::from("envoy")
}

/// A free loopback port (bound and released; Envoy binds it right after), never one this
/// process was handed before: the kernel may give a just-released port again, and two
/// calls in a row then named one port for two listeners.
pub fn free_port() -> std::io::Result<u16> {
    static HANDED_OUT: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    for _ in 0..64 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        if HANDED_OUT
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(port)
        {
            return Ok(port);
        }
    }
    Err(std::io::Error::other(
        "every free port the kernel offered was handed out before",
    ))
}

/// `n` consecutive free loopback ports, held (bound) until the listeners are dropped, for
/// processes that take a base port and add a pod's index: returns the first port.
pub fn reserve_port_range(n: u16) -> std::io::Result<(u16, Vec<std::net::TcpListener>)> {
    let n = n.max(1);
    for _ in 0..64 {
        let base = free_port()?;
        if base.checked_add(n).is_none() {
            continue;
        }
        let held: Result<Vec<_>, _> = (base..base + n)
            .map(|port| std::net::TcpListener::bind(("127.0.0.1", port)))
            .collect();
        if let Ok(held) = held {
            return Ok((base, held));
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::AddrInUse,
        format!("no {n} consecutive free ports on loopback"),
    ))
}

/// An Envoy child process, killed when dropped. Envoy 1.40 exits when the thread that
/// started it ends, so start it from a thread that outlives it (e.g. `main`).
#[derive(Debug)]
pub struct EnvoyProcess {
    child: Child,
    pub port: u16,
    pub admin_port: u16,
    dir: tempfile::TempDir,
}

/// Starts of Envoy tried when another process takes its port between [`free_port`] and
/// Envoy's bind.
const PORT_RACE_ATTEMPTS: usize = 3;

impl EnvoyProcess {
    pub async fn start(
        gateway: Gateway,
        pods: &[SocketAddr],
        binary: &Path,
        log_level: &str,
    ) -> Result<Self, GatewayError> {
        let mut attempt = 1;
        loop {
            match Self::start_once(gateway, pods, binary, log_level, None).await {
                Err(GatewayError::NotReady(_, log))
                    if log.contains("Address already in use") && attempt < PORT_RACE_ATTEMPTS =>
                {
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    /// Starts Envoy on the given listener and admin ports, once: a port another process
    /// holds is the caller's to report.
    pub async fn start_on(
        gateway: Gateway,
        pods: &[SocketAddr],
        binary: &Path,
        log_level: &str,
        listener: u16,
        admin: u16,
    ) -> Result<Self, GatewayError> {
        Self::start_once(gateway, pods, binary, log_level, Some((listener, admin))).await
    }

    /// One start, on `ports` (listener, admin) or on free ones.
    async fn start_once(
        gateway: Gateway,
        pods: &[SocketAddr],
        binary: &Path,
        log_level: &str,
        ports: Option<(u16, u16)>,
    ) -> Result<Self, GatewayError> {
        let dir = tempfile::tempdir()?;
        let (port, admin_port) = match ports {
            Some(ports) => ports,
            None => (free_port()?, free_port()?),
        };
        let config = match gateway {
            Gateway::OriginalDst { kvroute } => {
                rewrite_shipped(ORIGINAL_DST_CONFIG, port, admin_port, kvroute, pods)
            }
            Gateway::OverrideHost { kvroute } => {
                rewrite_shipped(OVERRIDE_HOST_CONFIG, port, admin_port, kvroute, pods)
            }
            Gateway::OriginalDstToHttpsPods { kvroute, pod_ca } => {
                assert!(
                    ORIGINAL_DST_CONFIG.contains(PODS_CLUSTER_HEAD),
                    "the shipped gateway's pod cluster changed: update this rewrite"
                );
                let tls =
                    PODS_TLS_TRANSPORT_SOCKET.replace("/etc/kvroute-gateway/pod-ca.pem", pod_ca);
                let template = ORIGINAL_DST_CONFIG
                    .replace(PODS_CLUSTER_HEAD, &format!("{PODS_CLUSTER_HEAD}{tls}"));
                rewrite_shipped(&template, port, admin_port, kvroute, pods)
            }
            Gateway::OriginalDstWithRequestBodyMode { kvroute, mode } => {
                const SHIPPED_MODE: &str = "request_body_mode: BUFFERED";
                assert!(
                    ORIGINAL_DST_CONFIG.contains(SHIPPED_MODE),
                    "the shipped gateway's request body mode changed: update this rewrite"
                );
                let template = ORIGINAL_DST_CONFIG
                    .replace(SHIPPED_MODE, &format!("request_body_mode: {mode}"));
                rewrite_shipped(&template, port, admin_port, kvroute, pods)
            }
            Gateway::OriginalDstOverTls { kvroute, certs } => {
                let tls = KVROUTE_TLS_TRANSPORT_SOCKET.replace("/etc/kvroute-gateway", certs);
                let template = ORIGINAL_DST_CONFIG.replace(
                    KVROUTE_CLUSTER_HEAD,
                    &format!("{KVROUTE_CLUSTER_HEAD}{tls}"),
                );
                rewrite_shipped(&template, port, admin_port, kvroute, pods)
            }
            Gateway::OriginalDstReplicas {
                kvroutes: [first, second],
                observed,
            } => {
                const ENDPOINT: &str = "              - endpoint:\n                  address:\n                    socket_address: { address: 127.0.0.1, port_value: 9002 }\n";
                assert!(
                    ORIGINAL_DST_CONFIG.contains(ENDPOINT),
                    "the shipped gateway's kvroute endpoint changed: update this rewrite"
                );
                let other = ENDPOINT.replace(
                    "address: 127.0.0.1, port_value: 9002",
                    &format!("address: {}, port_value: {}", second.ip(), second.port()),
                );
                let mut template =
                    ORIGINAL_DST_CONFIG.replace(ENDPOINT, &format!("{ENDPOINT}{other}"));
                if observed {
                    template = with_observer(&template);
                }
                rewrite_shipped(&template, port, admin_port, first, pods)
            }
            Gateway::OriginalDstObserved { kvroute } => {
                let template = with_observer(ORIGINAL_DST_CONFIG);
                rewrite_shipped(&template, port, admin_port, kvroute, pods)
            }
            Gateway::OverrideHostObserved { kvroute } => {
                let template = with_observer(OVERRIDE_HOST_CONFIG);
                rewrite_shipped(&template, port, admin_port, kvroute, pods)
            }
            Gateway::RoundRobin => plain_config(port, admin_port, "ROUND_ROBIN", pods),
            Gateway::LeastRequest => plain_config(port, admin_port, "LEAST_REQUEST", pods),
        };
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, config)?;
        let log = std::fs::File::create(dir.path().join("envoy.log"))?;
        let child = Command::new(binary)
            .arg("-c")
            .arg(&path)
            .args([
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                log_level,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(|source| GatewayError::Spawn {
                binary: binary.to_path_buf(),
                source,
            })?;
        let mut envoy = EnvoyProcess {
            child,
            port,
            admin_port,
            dir,
        };
        envoy.wait_ready(Duration::from_secs(20)).await?;
        Ok(envoy)
    }

    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), GatewayError> {
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .map_err(|e| GatewayError::NotReady(timeout, e.to_string()))?;
        let url = format!("http://127.0.0.1:{}/ready", self.admin_port);
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(response) = client.get(&url).send().await
                && response.status().is_success()
            {
                return Ok(());
            }
            // An Envoy that exited (a port taken meanwhile, a bad config) will not be ready.
            if self.exited().is_some() {
                return Err(GatewayError::NotReady(timeout, self.log()));
            }
            // Envoy is another process: no event to await, so poll its admin API.
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Err(GatewayError::NotReady(timeout, self.log()))
    }

    /// Envoy's process id (benchmarks read its CPU time).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A URL on the gateway's listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The configuration it runs.
    pub fn config_path(&self) -> PathBuf {
        self.dir.path().join("envoy.yaml")
    }

    /// Where it logs.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("envoy.log")
    }

    /// What Envoy logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewriting_swaps_ports_and_lists_the_pods() {
        let pods = [
            "127.0.0.1:18000".parse().expect("addr"),
            "127.0.0.1:18001".parse().expect("addr"),
        ];
        let kvroute = "127.0.0.1:19002".parse().expect("addr");
        let text = rewrite_shipped(OVERRIDE_HOST_CONFIG, 18080, 19901, kvroute, &pods);
        assert!(text.contains("port_value: 18080") && text.contains("port_value: 19901"));
        assert!(text.contains("port_value: 19002") && !text.contains("port_value: 9002"));
        assert!(text.contains("port_value: 18000") && text.contains("port_value: 18001"));
        assert!(
            !text.contains("port_value: 8000 "),
            "the example pods are replaced"
        );
        assert!(
            !text.contains("0.0.0.0"),
            "local gateways listen on loopback only"
        );
    }
}
