//! Where an object lives: a URL (`s3://bucket/key`, `gs://`, `az://`, `http(s)://`)
//! turned into a client for its store and the object's path in it.
//!
//! Credentials and settings come from the environment as each store's own tools read
//! them (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
//! `AWS_ENDPOINT_URL` for S3-compatible servers, …; `GOOGLE_*`; `AZURE_*`), through
//! `object_store`'s builders. Retries (with backoff) are the client's, bounded by
//! [`super::ObjectOptions`].

use std::sync::{Arc, Mutex};

use object_store::aws::AmazonS3ConfigKey;
use object_store::list::PaginatedListStore;
use object_store::path::Path as ObjectPath;
use object_store::{BackoffConfig, ObjectStore, ObjectStoreScheme, RetryConfig};
use url::Url;

use super::failure::{failed, Cause};
use super::options::ObjectOptions;
use crate::error::Result;

/// The URL schemes read from object storage (compared without case).
const SCHEMES: &[&str] = &[
    "s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https",
];

/// Whether `text` is an object-storage URL (`s3://…`, `gs://…`, `az://…`, `http(s)://…`)
/// rather than a local path.
///
/// ```
/// use tensorferry::internal::io::object::is_url;
/// assert!(is_url("s3://bucket/model.safetensors"));
/// assert!(!is_url("/data/model.safetensors"));
/// assert!(!is_url("s3:/relative/folder"));
/// ```
pub fn is_url(text: &str) -> bool {
    text.split_once("://")
        .is_some_and(|(scheme, _)| SCHEMES.iter().any(|s| s.eq_ignore_ascii_case(scheme)))
}

/// Whether S3 requests to `endpoint` (None: AWS's own, over HTTPS) are signed without
/// hashing their bodies, where the user's `AWS_UNSIGNED_PAYLOAD` does not say: over HTTPS,
/// as AWS's SDKs do, since TLS already protects the bytes and a SHA-256 pass over every
/// uploaded part would take a core's time from the upload; over plain HTTP the bodies stay
/// signed.
fn unsigned_payload(endpoint: Option<&str>) -> bool {
    endpoint.is_none_or(|e| {
        e.get(..8)
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("https://"))
    })
}

/// The URL a path holds, when it holds one.
pub(crate) fn url_of(path: &std::path::Path) -> Option<&str> {
    path.to_str().filter(|p| is_url(p))
}

/// An object (or a folder of objects, for a URL ending in `/`) and its store's client.
#[derive(Clone, Debug)]
pub(crate) struct Location {
    store: Arc<dyn ObjectStore>,
    /// The same store's listing a page at a time, where it has one (S3, GCS, Azure).
    pages: Option<Pages>,
    /// The object's path in the store.
    key: ObjectPath,
    /// The URL as given, for messages.
    url: String,
}

/// A store's listing a page at a time.
#[derive(Clone)]
pub(crate) struct Pages(Arc<dyn PaginatedListStore>);

impl std::fmt::Debug for Pages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pages")
    }
}

/// A store's client: its objects, and its listing a page at a time where it has one.
type Client = (Arc<dyn ObjectStore>, Option<Pages>);

/// The clients built so far: a client (its TLS roots read from the system, its pool of
/// open connections) is reused by every later open of an object in the same folder, made
/// in the same process with the same environment and options. Building one reads and
/// decodes the system's root certificates, a few milliseconds each time.
static CLIENTS: Mutex<Vec<(ClientKey, Client)>> = Mutex::new(Vec::new());

/// The most clients kept; the oldest goes first.
const CLIENTS_KEPT: usize = 16;

/// What a client was built from: the process (a forked child builds its own, as it runs
/// its own runtime), the folder's URL (a client serves every object beside the one it was
/// built for, as [`Location::sibling`] does), the whole environment (credentials,
/// endpoint, proxies: any change builds a new client) and the retry options.
#[derive(PartialEq)]
struct ClientKey {
    pid: u32,
    folder: String,
    env: Vec<(std::ffi::OsString, std::ffi::OsString)>,
    retries: (usize, std::time::Duration),
}

impl ClientKey {
    fn of(url: &str, options: &ObjectOptions) -> ClientKey {
        ClientKey {
            pid: std::process::id(),
            folder: folder_of(url).to_string(),
            env: std::env::vars_os().collect(),
            retries: (options.max_retries, options.retry_timeout),
        }
    }
}

/// `url` up to its last `/` after the scheme's (the URL itself where there is none: a
/// bucket's root), so that the folder always holds the store's whole address.
fn folder_of(url: &str) -> &str {
    let body = url.find("://").map_or(0, |i| i + 3);
    url[body..].rfind('/').map_or(url, |i| &url[..body + i])
}

/// The client `key` was built for, if one was.
fn client_for(key: &ClientKey) -> Option<Client> {
    let clients = CLIENTS.lock().unwrap_or_else(|p| p.into_inner());
    clients
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, c)| c.clone())
}

/// Keeps `client`, built for `key`. Clients of another process (this one's parent, before
/// a fork) are leaked, not dropped: their connections belong to the parent's runtime.
fn keep_client(key: ClientKey, client: Client) {
    let mut clients = CLIENTS.lock().unwrap_or_else(|p| p.into_inner());
    if clients.first().is_some_and(|(k, _)| k.pid != key.pid) {
        std::mem::forget(std::mem::take(&mut *clients));
    }
    if clients.len() >= CLIENTS_KEPT {
        clients.remove(0);
    }
    clients.push((key, client));
}

impl Location {
    /// The object at `url`, with a client built from the environment and `options` (or
    /// the one built before for the same folder, environment and options).
    pub(crate) fn open(url: &str, options: &ObjectOptions) -> Result<Location> {
        super::runtime::install_tls_provider();
        let bad = |detail: String| failed("open", url, Cause::BadConfig, detail);
        let parsed = Url::parse(url).map_err(|e| bad(format!("not a URL: {e}")))?;
        let (scheme, key) = ObjectStoreScheme::parse(&parsed).map_err(|e| bad(e.to_string()))?;
        let client_key = ClientKey::of(url, options);
        let (store, pages) = match client_for(&client_key) {
            Some(client) => client,
            None => {
                let client = build_client(url, &parsed, scheme, options)?;
                keep_client(client_key, client.clone());
                client
            }
        };
        Ok(Location {
            store,
            pages,
            key,
            url: url.to_string(),
        })
    }

    /// The store's client.
    pub(crate) fn store(&self) -> &dyn ObjectStore {
        &*self.store
    }

    /// The store's listing a page at a time, where it has one (not over HTTP).
    pub(crate) fn pages(&self) -> Option<&dyn PaginatedListStore> {
        self.pages.as_ref().map(|p| &*p.0)
    }

    /// The object's path in its store.
    pub(crate) fn key(&self) -> &ObjectPath {
        &self.key
    }

    /// The URL, for messages.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// Whether the URL names a folder (ends in `/`) rather than an object.
    pub(crate) fn is_folder(&self) -> bool {
        self.url.ends_with('/') || self.key.as_ref().is_empty()
    }

    /// The object's name: the last part of its path.
    pub(crate) fn name(&self) -> &str {
        self.key.filename().unwrap_or("")
    }

    /// The object `name` in the same folder as this one (in this folder, for a folder).
    pub(crate) fn sibling(&self, name: &str) -> Location {
        let (folder_key, folder_url) = if self.is_folder() {
            (self.key.clone(), self.url.trim_end_matches('/').to_string())
        } else {
            let parts: Vec<_> = self.key.parts().collect();
            let parent =
                ObjectPath::from_iter(parts[..parts.len().saturating_sub(1)].iter().cloned());
            let url = self.url.rsplit_once('/').map_or("", |(head, _)| head);
            (parent, url.to_string())
        };
        Location {
            store: self.store.clone(),
            pages: self.pages.clone(),
            key: folder_key.clone().join(name),
            url: format!("{folder_url}/{name}"),
        }
    }
}

/// A new client for the store `url` (parsed as `parsed`, of `scheme`) names, from the
/// environment and `options`.
fn build_client(
    url: &str,
    parsed: &Url,
    scheme: ObjectStoreScheme,
    options: &ObjectOptions,
) -> Result<Client> {
    let bad = |detail: String| failed("open", url, Cause::BadConfig, detail);
    let retry = RetryConfig {
        backoff: BackoffConfig::default(),
        max_retries: options.max_retries,
        retry_timeout: options.retry_timeout,
    };
    let built: object_store::Result<Client> = match scheme {
        ObjectStoreScheme::AmazonS3 => {
            let builder = object_store::aws::AmazonS3Builder::from_env()
                .with_url(url)
                // An endpoint the user set to plain HTTP (a server on the same
                // network) is taken as given.
                .with_allow_http(true)
                .with_retry(retry);
            let endpoint = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
            let builder = if std::env::var_os("AWS_UNSIGNED_PAYLOAD").is_some() {
                builder // the user's choice, read by from_env
            } else {
                builder.with_unsigned_payload(unsigned_payload(endpoint.as_deref()))
            };
            builder.build().map(paged)
        }
        ObjectStoreScheme::GoogleCloudStorage => {
            object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_url(url)
                .with_retry(retry)
                .build()
                .map(paged)
        }
        ObjectStoreScheme::MicrosoftAzure => object_store::azure::MicrosoftAzureBuilder::from_env()
            .with_url(url)
            .with_retry(retry)
            .build()
            .map(paged),
        ObjectStoreScheme::Http => object_store::http::HttpBuilder::new()
            .with_url(&parsed[..url::Position::BeforePath])
            .with_retry(retry)
            .with_client_options(object_store::ClientOptions::new().with_allow_http(true))
            .build()
            .map(|s| (Arc::new(s) as _, None)),
        other => return Err(bad(format!("{other:?} is not an object store"))),
    };
    built.map_err(|e| super::failure::from_store("open", url, e))
}

/// A client of a store that lists a page at a time.
fn paged<S: ObjectStore + PaginatedListStore>(store: S) -> Client {
    let store = Arc::new(store);
    (store.clone(), Some(Pages(store)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opened(url: &str) -> Location {
        // Explicit settings: no environment, no network (building a client connects to
        // nothing).
        Location::open(url, &ObjectOptions::default()).unwrap()
    }

    #[test]
    fn a_client_serves_its_folder_only() {
        assert_eq!(folder_of("s3://b/run/model.safetensors"), "s3://b/run");
        assert_eq!(folder_of("s3://b/run/"), "s3://b/run");
        assert_eq!(folder_of("s3://b/x"), "s3://b");
        assert_eq!(folder_of("s3://b"), "s3://b");
        assert_eq!(folder_of("https://h:9/c/x"), "https://h:9/c");
        let (a, b) = (opened("s3://a/x"), opened("s3://b/x"));
        assert!(!Arc::ptr_eq(&a.store, &b.store), "buckets share no client");
        let (x, y) = (opened("s3://a/d/x"), opened("s3://a/d/y"));
        assert!(Arc::ptr_eq(&x.store, &y.store), "one folder, one client");
        let later = Location::open(
            "s3://a/d/x",
            &ObjectOptions {
                max_retries: 1,
                ..ObjectOptions::default()
            },
        )
        .unwrap();
        assert!(
            !Arc::ptr_eq(&x.store, &later.store),
            "other options, other client"
        );
    }

    #[test]
    fn bodies_are_signed_unhashed_over_https_only() {
        assert!(unsigned_payload(None), "AWS's own endpoints are HTTPS");
        assert!(unsigned_payload(Some("https://s3.example.com")));
        assert!(unsigned_payload(Some("HTTPS://s3.example.com")));
        assert!(!unsigned_payload(Some("http://127.0.0.1:9000")));
        assert!(!unsigned_payload(Some("http")));
    }

    #[test]
    fn object_urls_are_told_from_local_paths() {
        for url in [
            "s3://b/k",
            "S3://b/k",
            "gs://b/k",
            "az://c/k",
            "https://h/x",
            "http://h/x",
        ] {
            assert!(is_url(url), "{url}");
        }
        for path in [
            "/tmp/x.safetensors",
            "x.safetensors",
            "file:///tmp/x",
            "s3:/b",
            "ftp://h/x",
        ] {
            assert!(!is_url(path), "{path}");
        }
    }

    #[test]
    fn an_s3_url_gives_the_key_inside_the_bucket() {
        let at = opened("s3://bucket/run/7/model.safetensors");
        assert_eq!(at.key().as_ref(), "run/7/model.safetensors");
        assert_eq!(at.name(), "model.safetensors");
        assert!(!at.is_folder());
    }

    #[test]
    fn siblings_share_the_folder_of_an_object_or_live_in_a_folder() {
        let file = opened("s3://bucket/run/model.safetensors");
        let index = file.sibling("model.safetensors.index.json");
        assert_eq!(index.key().as_ref(), "run/model.safetensors.index.json");
        assert_eq!(index.url(), "s3://bucket/run/model.safetensors.index.json");
        let folder = opened("s3://bucket/run/");
        assert!(folder.is_folder());
        let inside = folder.sibling("model.safetensors");
        assert_eq!(inside.key().as_ref(), "run/model.safetensors");
        assert_eq!(inside.url(), "s3://bucket/run/model.safetensors");
        let root = opened("s3://bucket/").sibling("x.safetensors");
        assert_eq!(root.key().as_ref(), "x.safetensors");
        assert_eq!(root.url(), "s3://bucket/x.safetensors");
    }

    #[test]
    fn a_url_that_names_no_store_is_a_configuration_error() {
        let e = Location::open("s3://", &ObjectOptions::default()).unwrap_err();
        assert_eq!(super::super::cause_of(&e), Some(Cause::BadConfig), "{e}");
    }
}
