//! The campaign's command line: `--help` documents the flags the README uses, and a wrong
//! flag is a clear usage error, not a campaign. (Building this test also builds the binary
//! that `.ci/run` runs.)

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_idempotency-chaos");

#[test]
fn help_documents_every_flag() {
    let out = Command::new(BIN).arg("--help").output().expect("run");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--seed",
        "--duration-s",
        "--gateways",
        "--clients",
        "--lease-ms",
        "--demo-bin",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help:\n{help}");
    }
}

#[test]
fn a_wrong_flag_is_a_usage_error() {
    let out = Command::new(BIN)
        .args(["--gateways", "0"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--gateways"));
}
