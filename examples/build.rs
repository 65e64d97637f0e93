//! Compiles `proto/payments.proto` for the protobuf example, with the protoc
//! that `protoc-bin-vendored` ships, so no system package is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/payments.proto");
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    prost_build::Config::new()
        .protoc_executable(protoc)
        .compile_protos(&["proto/payments.proto"], &["proto"])?;
    Ok(())
}
