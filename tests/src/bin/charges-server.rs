//! The charges example's binary, built beside the tests so that the reliability
//! harness can run it as real OS processes (`CARGO_BIN_EXE_charges-server`).

use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    charges::init_logging("warn");
    match charges::main_from_env().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("charges: {}", charges::one_line(&error));
            ExitCode::FAILURE
        }
    }
}
