//! Size bounds on what the Karmada API server sends: a layer under the kube client that cuts
//! every response body off at a bound, so a broken or hostile server cannot make the replica
//! buffer without end (kube reads whole bodies, and watch lines of any length, into memory).
//!
//! Which bound applies is decided from the request: a watch (`watch=true`) is bounded per
//! event (the bytes between two newlines), a paged collection read (a `limit` parameter: the
//! watcher's lists) by [`Limits::list`], every other answer (get, patch, discovery, Event
//! writes) by [`Limits::object`]. Past the bound the body ends with [`TooLarge`], which names
//! the request and the bound; [`super::KarmadaError::TooLarge`] carries it with the object.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use hyper::body::{Body, Bytes, Frame, SizeHint};
use hyper::{Request, Response, Uri};

/// Bounds of response bodies, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// One object's answer (get, patch) and one watch event.
    pub object: usize,
    /// One page of a collection read.
    pub list: usize,
}

impl Default for Limits {
    /// 4 MiB per object: the API server refuses requests over 3 MiB and etcd stores at most
    /// 1.5 MiB per value, so a served object plus its watch envelope stays below. 64 MiB per
    /// list page: the watcher pages by 500, so an average of 128 KiB per object.
    fn default() -> Limits {
        Limits {
            object: 4 << 20,
            list: 64 << 20,
        }
    }
}

/// A response body cut off at its bound.
#[derive(Debug, thiserror::Error)]
#[error("{what} from {request} exceeds the bound of {limit} bytes")]
pub struct TooLarge {
    /// `the answer` or `a watch event`.
    pub what: &'static str,
    /// The request: method and path.
    pub request: String,
    /// The bound.
    pub limit: usize,
}

/// The [`tower::Layer`] bounding every response of the service below it.
#[derive(Clone, Copy, Debug)]
pub struct BoundLayer(pub Limits);

impl<S> tower::Layer<S> for BoundLayer {
    type Service = Bounded<S>;

    fn layer(&self, inner: S) -> Bounded<S> {
        Bounded {
            inner,
            limits: self.0,
        }
    }
}

/// A service whose response bodies are [`BoundedBody`].
#[derive(Clone, Debug)]
pub struct Bounded<S> {
    inner: S,
    limits: Limits,
}

/// How a body is counted.
#[derive(Clone, Copy, Debug)]
enum Count {
    /// All bytes.
    Total,
    /// Bytes since the last newline.
    PerLine,
}

/// Whether `uri`'s query has `name` set (`name=...`), and to what.
fn query_value<'a>(uri: &'a Uri, name: &str) -> Option<&'a str> {
    uri.query()?.split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        (k == name).then_some(v)
    })
}

impl<S, ReqBody, B> tower::Service<Request<ReqBody>> for Bounded<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: 'static,
{
    type Response = Response<BoundedBody<B>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let uri = req.uri();
        let watch = matches!(query_value(uri, "watch"), Some("true" | "1"));
        let (count, what, limit) = if watch {
            (Count::PerLine, "a watch event", self.limits.object)
        } else if query_value(uri, "limit").is_some() {
            (Count::Total, "the answer", self.limits.list)
        } else {
            (Count::Total, "the answer", self.limits.object)
        };
        let request = format!("{} {}", req.method(), uri.path());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await?;
            Ok(res.map(|inner| BoundedBody {
                inner: Box::pin(inner),
                count,
                seen: 0,
                limit,
                what,
                request,
                failed: false,
            }))
        })
    }
}

/// A response body that fails with [`TooLarge`] once it passes its bound.
pub struct BoundedBody<B> {
    inner: Pin<Box<B>>,
    count: Count,
    /// Bytes counted so far (of the current line, per line).
    seen: usize,
    limit: usize,
    what: &'static str,
    request: String,
    failed: bool,
}

impl<B> BoundedBody<B> {
    /// Counts `data`; false once the bound is passed.
    fn admit(&mut self, data: &[u8]) -> bool {
        match self.count {
            Count::Total => self.seen = self.seen.saturating_add(data.len()),
            Count::PerLine => {
                let mut lines = data.split(|b| *b == b'\n');
                // The first piece continues the current line; each later one starts a line.
                if let Some(first) = lines.next() {
                    self.seen = self.seen.saturating_add(first.len());
                }
                for line in lines {
                    if self.seen > self.limit {
                        return false;
                    }
                    self.seen = line.len();
                }
            }
        }
        self.seen <= self.limit
    }
}

impl<B> Body for BoundedBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match self.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => return Poll::Pending,
        };
        let this = &mut *self;
        if let Some(data) = frame.data_ref()
            && !this.admit(data)
        {
            this.failed = true;
            return Poll::Ready(Some(Err(Box::new(TooLarge {
                what: this.what,
                request: std::mem::take(&mut this.request),
                limit: this.limit,
            }))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(count: Count, limit: usize) -> BoundedBody<http_body_util::Empty<Bytes>> {
        BoundedBody {
            inner: Box::pin(http_body_util::Empty::new()),
            count,
            seen: 0,
            limit,
            what: "the answer",
            request: "GET /x".into(),
            failed: false,
        }
    }

    #[test]
    fn totals_count_every_byte() {
        let mut b = body(Count::Total, 10);
        assert!(b.admit(b"12345"));
        assert!(b.admit(b"\n2345"));
        assert!(!b.admit(b"1"), "the 11th byte passes the bound");
    }

    #[test]
    fn watch_lines_are_bounded_one_at_a_time() {
        let mut b = body(Count::PerLine, 4);
        // Many short lines, in total far past the bound.
        for _ in 0..100 {
            assert!(b.admit(b"abc\nde\n"));
        }
        // A line split over chunks counts as one.
        assert!(b.admit(b"ab"));
        assert!(b.admit(b"cd"));
        assert!(!b.admit(b"e\n"), "5 bytes in one line");
        // A long line followed by a newline in the same chunk is still too long.
        let mut b = body(Count::PerLine, 4);
        assert!(!b.admit(b"abcdef\nx"));
    }

    #[test]
    fn the_bound_follows_the_request() {
        let uri: Uri = "/apis/x/v1/things?watch=true&resourceVersion=5"
            .parse()
            .unwrap();
        assert_eq!(query_value(&uri, "watch"), Some("true"));
        assert_eq!(query_value(&uri, "limit"), None);
        let uri: Uri = "/apis/x/v1/things?limit=500".parse().unwrap();
        assert_eq!(query_value(&uri, "limit"), Some("500"));
        let uri: Uri = "/apis/x/v1/things/a".parse().unwrap();
        assert_eq!(query_value(&uri, "watch"), None);
    }
}
