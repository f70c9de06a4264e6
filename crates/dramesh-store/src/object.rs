//! Object identity and change types exchanged with the estimation view, from `dramesh-model`.

pub use dramesh_model::object::{ObjectChange, ObjectKey, ObjectKind};
