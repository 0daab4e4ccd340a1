//! The layer composes with the middleware a tower user already runs: each test serves real
//! requests on 127.0.0.1 through one named stack (axum's `Router::layer` and `route_layer` with a
//! `ServiceBuilder`, tower's own layers, a boxed service, tonic's server, a bare hyper-util server)
//! and checks both that the stack compiles (the layers that build their own response with
//! `ResBody::default()` need the crate's bodies to implement `Default`) and that each layer still
//! does its job with this one inside it.
//!
//! The stacks are written once, in composition/stacks.rs, and run over each tower-http version the
//! crate is tested with: 0.7 (the README's) and 0.6.

/// The stacks over tower-http 0.7.
#[path = "composition/stacks.rs"]
mod tower_http_0_7;

/// The same stacks over tower-http 0.6 (`tower-http-06` in Cargo.toml's dev-dependencies).
mod tower_http_0_6 {
    use tower_http_06 as tower_http;
    include!("composition/stacks.rs");
}
