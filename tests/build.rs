//! Generates the tonic service of `proto/charges.proto` (the gRPC tests and the book's
//! gRPC chapter) with `protoc`, Debian's `protobuf-compiler`, which `.ci/run` installs.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/charges.proto");
    tonic_prost_build::configure().compile_protos(&["proto/charges.proto"], &["proto"])?;
    Ok(())
}
