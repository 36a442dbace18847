// libdat2 dlopen()s the provider and dlclose()s it after the last IA closes, but the
// stack keeps threads (event threads, an embedded kAL's device threads) that must never
// find their code unmapped: the library is marked "nodelete", so dlclose leaves it
// loaded and a later dlopen finds it as it was (dat_provider_init runs again on it).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
