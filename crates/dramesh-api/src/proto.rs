//! Code generated from `proto/` by `build.rs`. The module tree mirrors the protobuf packages
//! because generated code refers to other packages through relative `super::` paths.

#![allow(clippy::all, clippy::pedantic, missing_docs, rustdoc::all)]

pub mod github {
    pub mod com {
        pub mod karmada_io {
            pub mod karmada {
                pub mod pkg {
                    pub mod estimator {
                        /// Karmada estimator messages (package `github.com.karmada_io.karmada.pkg.estimator.pb`).
                        pub mod pb {
                            include!(concat!(
                                env!("OUT_DIR"),
                                "/github.com.karmada_io.karmada.pkg.estimator.pb.rs"
                            ));
                        }
                        /// The `Estimator` service (package `github.com.karmada_io.karmada.pkg.estimator.service`).
                        pub mod service {
                            include!(concat!(
                                env!("OUT_DIR"),
                                "/github.com.karmada_io.karmada.pkg.estimator.service.rs"
                            ));
                        }
                    }
                }
            }
        }
    }
}

pub mod k8s {
    pub mod io {
        pub mod api {
            pub mod core {
                /// Minimal `k8s.io.api.core.v1` messages (NodeSelector, Toleration).
                pub mod v1 {
                    include!(concat!(env!("OUT_DIR"), "/k8s.io.api.core.v1.rs"));
                }
            }
        }
        pub mod apimachinery {
            pub mod pkg {
                pub mod api {
                    /// `k8s.io.apimachinery.pkg.api.resource.Quantity`.
                    pub mod resource {
                        include!(concat!(
                            env!("OUT_DIR"),
                            "/k8s.io.apimachinery.pkg.api.resource.rs"
                        ));
                    }
                }
            }
        }
    }
}

pub mod dramesh {
    /// The native dramesh.v1 API.
    pub mod v1 {
        include!(concat!(env!("OUT_DIR"), "/dramesh.v1.rs"));
    }
}

pub use dramesh::v1 as native;
pub use github::com::karmada_io::karmada::pkg::estimator::pb as karmada;
pub use github::com::karmada_io::karmada::pkg::estimator::service as karmada_service;
pub use k8s::io::api::core::v1 as k8s_core;
pub use k8s::io::apimachinery::pkg::api::resource as k8s_resource;
