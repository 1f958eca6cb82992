//! A worker's identity: its id in the pool and its base URL.

use hyper::Uri;

/// A worker's id, given in registration order and never reused (a worker removed and added
/// again gets a new one), so an id held by an in-flight request cannot point at another
/// worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub u64);

/// A worker's base URL, `http://host:port` with an optional path prefix and no trailing
/// slash. Request paths are appended to it as they came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUrl {
    /// The URL as requests are built from it, e.g. `http://10.0.0.5:8000`.
    base: String,
    /// `host:port`, sent as the `Host` header.
    authority: String,
}

impl WorkerUrl {
    /// Parses a worker URL as given on the command line or to `POST /workers`.
    pub fn parse(text: &str) -> Result<WorkerUrl, String> {
        let base = text.trim().trim_end_matches('/');
        if !base.starts_with("http://") {
            return Err(format!(
                "worker URL '{text}' must start with http:// (the router speaks plain HTTP/1.1 \
                 to workers)"
            ));
        }
        let uri: Uri = base.parse().map_err(|error| format!("worker URL '{text}': {error}"))?;
        let Some(authority) = uri.authority() else {
            return Err(format!("worker URL '{text}' has no host"));
        };
        if uri.query().is_some() || base.contains('#') {
            return Err(format!("worker URL '{text}' must not have a query or fragment"));
        }
        Ok(WorkerUrl { authority: authority.to_string(), base: base.to_string() })
    }

    /// The base URL, e.g. `http://10.0.0.5:8000`.
    pub fn as_str(&self) -> &str {
        &self.base
    }

    /// `host:port`, the `Host` header for requests to this worker.
    pub fn authority(&self) -> &str {
        &self.authority
    }

    /// The URL of `path_and_query` (starting with `/`) on this worker.
    pub fn endpoint(&self, path_and_query: &str) -> Result<Uri, String> {
        format!("{}{path_and_query}", self.base)
            .parse()
            .map_err(|error| format!("'{path_and_query}' on {}: {error}", self.base))
    }
}

impl std::fmt::Display for WorkerUrl {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_keeps_its_path_prefix_and_loses_its_trailing_slash() {
        let url = WorkerUrl::parse(" http://10.0.0.5:8000/prefix/ ").unwrap();
        assert_eq!(url.as_str(), "http://10.0.0.5:8000/prefix");
        assert_eq!(url.authority(), "10.0.0.5:8000");
        let endpoint = url.endpoint("/v1/models?x=1").unwrap();
        assert_eq!(endpoint.to_string(), "http://10.0.0.5:8000/prefix/v1/models?x=1");
    }

    #[test]
    fn urls_without_http_or_a_host_or_with_a_query_are_refused_with_a_reason() {
        let https = WorkerUrl::parse("https://worker:8000").unwrap_err();
        assert!(https.contains("must start with http://"), "{https}");
        assert!(WorkerUrl::parse("worker:8000").is_err());
        assert!(WorkerUrl::parse("http://").is_err());
        let query = WorkerUrl::parse("http://worker:8000/?a=b").unwrap_err();
        assert!(query.contains("query"), "{query}");
    }
}
