use crate::model::{FieldError, ObjectRef};

/// An object the engine rejected. It names the object and the field, e.g.
/// `networkpolicy x/deny-all: spec.ingress[0].ports[1].endPort: must be >= port (80)`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{object}: {field}: {reason}")]
    Invalid {
        object: ObjectRef,
        field: String,
        reason: String,
    },
}

impl PolicyError {
    pub fn invalid(object: &ObjectRef, e: FieldError) -> Self {
        PolicyError::Invalid {
            object: object.clone(),
            field: e.field,
            reason: e.reason,
        }
    }

    pub fn object(&self) -> &ObjectRef {
        match self {
            PolicyError::Invalid { object, .. } => object,
        }
    }
}
