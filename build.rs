//! With the `torch` feature, give every linked artifact (the binary, tests, examples) an
//! rpath to libtorch's library directory, so they run without `LD_LIBRARY_PATH`.
//! torch-sys (`links = "tch"`) reports that directory as `DEP_TCH_LIBTORCH_LIB`; it is only
//! visible here because torch-sys is a direct (optional) dependency. Without the feature
//! this does nothing and the default build needs no libtorch.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if std::env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(dir) if !dir.is_empty() => {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
        _ => println!(
            "cargo:warning=torch-sys did not report libtorch's library directory; \
             binaries built with --features torch will need LD_LIBRARY_PATH=$LIBTORCH/lib"
        ),
    }
}
