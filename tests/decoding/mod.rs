//! Decoding a response body as an HTTP client does, for the tests that compress (kept out of
//! `test_support::serve`, which the binary's package uses too and which has no tower-http).

use std::convert::Infallible;

use bytes::Bytes;
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;

use test_support::serve::{BoxError, PATIENCE};

/// The body of `res`, decoded from its `content-encoding` (gzip, br, zstd, deflate or none) by
/// tower-http's client-side `Decompression`, as a string.
pub(crate) async fn decoded<B>(res: Response<B>) -> String
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    use tower::ServiceExt;
    let mut res = Some(res);
    let svc = tower::ServiceBuilder::new()
        .layer(tower_http::decompression::DecompressionLayer::new())
        .service(tower::service_fn(move |_req: http::Request<()>| {
            let res = res.take().expect("one response");
            async move { Ok::<_, Infallible>(res) }
        }));
    let res = svc.oneshot(http::Request::new(())).await.unwrap();
    let bytes = tokio::time::timeout(PATIENCE, res.into_body().collect())
        .await
        .expect("body did not end in time")
        .map_err(|e| e.to_string())
        .expect("the body did not decode")
        .to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}
