//! The S3 backend: the client `s3://` URLs get, and what S3 answers that
//! `object_store`'s errors do not say in their type.
//!
//! `object_store` turns a 404 whose S3 error code is `NoSuchBucket` into
//! the same error as a missing key (or, for a listing, a generic one), and
//! a failed request for instance credentials into a generic error. The
//! client's HTTP service here looks at each answer as it arrives and
//! fails those two requests with an error of its own type
//! ([`S3Answer`]), which reaches [`answer_of`] down the `source()` chain
//! of the `object_store` error: the mapping to [`Error`](crate::Error)
//! goes by type, never by an error message's text.

use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::client::{
    HttpClient, HttpConnector, HttpError, HttpErrorKind, HttpRequest, HttpResponse,
    HttpResponseBody, HttpService, ReqwestConnector,
};

use crate::Result;

/// The longest error body looked at for its S3 error code.
const MAX_ERROR_BODY: usize = 64 << 10;

/// What S3 answered, where `object_store` keeps no type for it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum S3Answer {
    /// A 404 with the error code `NoSuchBucket`.
    #[error("the server answered 404 NoSuchBucket")]
    NoSuchBucket,
    /// A request to the instance metadata endpoint (where the client looks
    /// for credentials when the environment names none) failed, or was
    /// refused.
    #[error("the instance metadata endpoint {endpoint} gave no credentials ({why})")]
    NoInstanceCredentials {
        endpoint: String,
        why: String,
        #[source]
        source: Option<HttpError>,
    },
}

/// The first [`S3Answer`] in `e`'s chain of sources.
pub(crate) fn answer_of<'e>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e S3Answer> {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(answer) = e.downcast_ref::<S3Answer>() {
            return Some(answer);
        }
        next = e.source();
    }
    None
}

/// The client for bucket `bucket`, configured from the environment, whose
/// requests are retried for `window` and sent through `connector` (none:
/// reqwest's, over TLS by ring); its error is mapped by the caller.
pub(crate) fn s3_store(
    bucket: &str,
    window: Duration,
    connector: Option<Arc<dyn HttpConnector>>,
) -> object_store::Result<Arc<AmazonS3>> {
    use object_store::aws::AmazonS3ConfigKey;
    // Retries end when the window is over, not after a count: waits are
    // random (jitter), so a count gives no bound in time.
    let retry = object_store::RetryConfig {
        max_retries: 1_000,
        retry_timeout: window,
        backoff: object_store::BackoffConfig {
            init_backoff: super::FIRST_RETRY_WAIT,
            max_backoff: super::LONGEST_RETRY_WAIT,
            base: 2.0,
        },
    };
    // Client options replace those from_env read: take the one that
    // matters here again.
    let allow_http =
        std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
    let client = object_store::ClientOptions::new()
        .with_allow_http(allow_http)
        .with_timeout(super::REQUEST_TIMEOUT)
        .with_connect_timeout(super::CONNECT_TIMEOUT);
    let builder = AmazonS3Builder::from_env();
    let metadata = builder
        .get_config_value(&AmazonS3ConfigKey::MetadataEndpoint)
        .unwrap_or_else(|| "http://169.254.169.254".to_owned());
    let metadata = metadata.parse::<http::Uri>().ok().and_then(|u| {
        let authority = u.authority()?;
        Some(authority.as_str().to_owned())
    });
    // With the IMDSv1 fallback on, a refused token request is followed by
    // another request: only that one's failure is final.
    let imdsv1_fallback = builder
        .get_config_value(&AmazonS3ConfigKey::ImdsV1Fallback)
        .is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let builder = with_body_checks(builder);
    let s3 = builder
        .with_bucket_name(bucket)
        .with_retry(retry)
        .with_client_options(client)
        .with_http_connector(Observing {
            inner: connector,
            metadata,
            imdsv1_fallback,
        })
        .build()?;
    Ok(Arc::new(s3))
}

/// How a request's body is protected, unless the environment says
/// otherwise (`AWS_UNSIGNED_PAYLOAD`, `AWS_CHECKSUM_ALGORITHM`): not
/// signed (a SHA-256 of every body on the writer's CPU, and again on the
/// server's, where uploads of a whole state are bounded by CPU), but
/// checked end to end by a CRC-64/NVME of the body that the server
/// verifies before it stores the object (a body changed on the way is
/// refused, and the save fails rather than acknowledging bytes that will
/// not load). s3torchconnector leaves bodies unsigned too.
fn with_body_checks(builder: AmazonS3Builder) -> AmazonS3Builder {
    use object_store::aws::Checksum;
    let set = |key: &str| std::env::var_os(key).is_some();
    if set("AWS_UNSIGNED_PAYLOAD") || set("AWS_CHECKSUM_ALGORITHM") {
        return builder;
    }
    builder
        .with_unsigned_payload(true)
        .with_checksum_algorithm(Checksum::CRC64NVME)
}

/// Connects clients whose service is [`Observed`].
#[derive(Debug)]
struct Observing {
    /// The connector whose clients send the requests (none: reqwest's).
    inner: Option<Arc<dyn HttpConnector>>,
    /// The authority (`host:port`) of the instance metadata endpoint.
    metadata: Option<String>,
    imdsv1_fallback: bool,
}

impl HttpConnector for Observing {
    fn connect(&self, options: &object_store::ClientOptions) -> object_store::Result<HttpClient> {
        // TLS through ring, which builds in a fraction of aws-lc-rs's time
        // (object_store's `aws` feature would bring that); a provider the
        // process installed first is kept.
        let inner = if let Some(connector) = &self.inner {
            connector.connect(options)?
        } else {
            let _ = rustls::crypto::ring::default_provider().install_default();
            ReqwestConnector::default().connect(options)?
        };
        Ok(HttpClient::new(Observed {
            inner,
            metadata: self.metadata.clone(),
            imdsv1_fallback: self.imdsv1_fallback,
        }))
    }
}

/// The reqwest client, failing the answers [`S3Answer`] names.
#[derive(Debug)]
struct Observed {
    inner: HttpClient,
    metadata: Option<String>,
    imdsv1_fallback: bool,
}

#[async_trait::async_trait]
impl HttpService for Observed {
    async fn call(&self, req: HttpRequest) -> Result<HttpResponse, HttpError> {
        let authority = req.uri().authority().map(|a| a.as_str().to_owned());
        let to_metadata = authority.is_some() && authority == self.metadata;
        let token_request = req.method() == http::Method::PUT;
        let no_credentials =
            |why: String, source: Option<HttpError>| S3Answer::NoInstanceCredentials {
                endpoint: authority.clone().unwrap_or_default(),
                why,
                source,
            };
        let answer = match self.inner.execute(req).await {
            // Kept of the kind it was: retried as before.
            Err(source) if to_metadata => {
                let kind = source.kind();
                let answer = no_credentials("no answer".to_owned(), Some(source));
                return Err(HttpError::new(kind, answer));
            }
            other => other?,
        };
        let status = answer.status();
        let retried = status.is_server_error();
        let falls_back = self.imdsv1_fallback && token_request;
        if to_metadata && !status.is_success() && !retried && !falls_back {
            let answer = no_credentials(format!("{status}"), None);
            return Err(HttpError::new(HttpErrorKind::Unknown, answer));
        }
        if answer.status() != http::StatusCode::NOT_FOUND {
            return Ok(answer);
        }
        // The body of a 404 is an S3 error document of a few hundred
        // bytes; it is read here, at most MAX_ERROR_BODY of it, and handed
        // on (only error messages read it).
        let (parts, body) = answer.into_parts();
        let mut stream = body.bytes_stream();
        let mut bytes = Vec::new();
        while bytes.len() < MAX_ERROR_BODY {
            match futures::StreamExt::next(&mut stream).await {
                Some(piece) => bytes.extend_from_slice(&piece?),
                None => break,
            }
        }
        bytes.truncate(MAX_ERROR_BODY);
        if error_code(&bytes).as_deref() == Some("NoSuchBucket") {
            return Err(HttpError::new(
                HttpErrorKind::Unknown,
                S3Answer::NoSuchBucket,
            ));
        }
        Ok(HttpResponse::from_parts(
            parts,
            HttpResponseBody::from(bytes),
        ))
    }
}

/// The `Code` of an S3 error document (`<Error><Code>…</Code>…</Error>`).
fn error_code(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct ErrorDocument {
        #[serde(rename = "Code")]
        code: String,
    }
    let text = std::str::from_utf8(body).ok()?;
    quick_xml::de::from_str::<ErrorDocument>(text)
        .ok()
        .map(|d| d.code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_document_gives_its_code() {
        let body = br#"<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>NoSuchBucket</Code><Message>Bucket not found: x</Message><Resource>/x</Resource><Region>garage</Region></Error>"#;
        assert_eq!(error_code(body).as_deref(), Some("NoSuchBucket"));
        let key = br"<Error><Code>NoSuchKey</Code><Message>Key not found</Message></Error>";
        assert_eq!(error_code(key).as_deref(), Some("NoSuchKey"));
        assert_eq!(error_code(b"not xml"), None);
        assert_eq!(error_code(b""), None);
    }

    #[test]
    fn an_answer_is_found_down_the_chain_of_sources() {
        let e = object_store::Error::Generic {
            store: "S3",
            source: Box::new(HttpError::new(
                HttpErrorKind::Unknown,
                S3Answer::NoSuchBucket,
            )),
        };
        assert!(matches!(answer_of(&e), Some(S3Answer::NoSuchBucket)));
        let other = object_store::Error::Generic {
            store: "S3",
            source: "NoSuchBucket".into(),
        };
        assert!(answer_of(&other).is_none(), "by type, not by text");
    }
}
