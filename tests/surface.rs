//! The crate's public surface as cargo and docs.rs see it.

/// The `[features]` table of the crate's manifest: each feature's name.
fn features() -> Vec<String> {
    let manifest = include_str!("../Cargo.toml");
    let mut in_features = false;
    let mut names = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with("[") && !line.starts_with("[\"") {
            in_features = line == "[features]";
        } else if in_features && !line.starts_with('#') {
            // `name = [...]`, on one line or continued on the next ones (which hold no `=`).
            if let Some((name, _)) = line.split_once('=') {
                names.push(name.trim().to_owned());
            }
        }
    }
    names
}

/// Every cargo feature shows under `--all-features` and on docs.rs: no test-only or hidden
/// features (the fuzz targets use the public sans-IO API).
#[test]
fn cargo_features_are_only_the_documented_ones() {
    let features = features();
    assert_eq!(features, ["default", "tracing", "json"], "{features:?}");
    assert!(features.iter().all(|f| !f.starts_with('_')));
}

#[test]
fn docs_rs_builds_with_every_feature() {
    let manifest = include_str!("../Cargo.toml");
    let at = manifest
        .find("[package.metadata.docs.rs]")
        .expect("a docs.rs section");
    let section = manifest[at..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with('['));
    assert!(section.map(str::trim).any(|l| l == "all-features = true"));
}
