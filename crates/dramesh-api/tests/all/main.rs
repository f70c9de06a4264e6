//! The integration tests of dramesh-api, as one test binary (each file a module; nextest still runs every test in its own process).
mod common;

mod admission;
mod auth;
mod grpc;
mod http;
mod tokenreview;
