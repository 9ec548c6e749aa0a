//! Compiles kvroute's own protos (`proto/`) with pure-Rust tools: protox parses the
//! .proto files into a descriptor set, tonic-prost-build generates the messages and
//! the tonic service into OUT_DIR. No `protoc` needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const ADMIN: &str = "proto/kvroute/admin/v1/admin.proto";
    println!("cargo:rerun-if-changed={ADMIN}");
    let descriptors = protox::compile([ADMIN], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // For `kvroute tap --json` / `kvroute endpoints --json`.
        .type_attribute(".kvroute.admin.v1", "#[derive(serde::Serialize)]")
        .type_attribute(
            ".kvroute.admin.v1.DecisionEvent.outcome",
            "#[serde(rename_all = \"snake_case\")]",
        )
        .compile_fds(descriptors)?;
    Ok(())
}
