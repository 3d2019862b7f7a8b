//! Every error the edge returns becomes a gRPC status here, and only here: the code says what
//! kind, the message names the field.

use tonic::Status;

use super::access::AccessDenied;
use super::error::EdgeError;
use super::validate::ValidationError;
use crate::backend::BackendError;
use crate::core::CoreError;
use crate::session::AttachError;
use crate::store::StoreError;

impl From<EdgeError> for Status {
    fn from(e: EdgeError) -> Status {
        match e {
            EdgeError::NoAttach { .. } => Status::deadline_exceeded(e.to_string()),
            EdgeError::NoPeer | EdgeError::Task { .. } => Status::internal(e.to_string()),
        }
    }
}

impl From<AccessDenied> for Status {
    fn from(e: AccessDenied) -> Status {
        Status::permission_denied(e.to_string())
    }
}

impl From<ValidationError> for Status {
    fn from(e: ValidationError) -> Status {
        Status::invalid_argument(e.to_string())
    }
}

impl From<CoreError> for Status {
    fn from(e: CoreError) -> Status {
        status_of(&e)
    }
}

impl From<StoreError> for Status {
    fn from(e: StoreError) -> Status {
        status_of(&e.into())
    }
}

/// The gRPC status for a core error.
pub fn status_of(e: &CoreError) -> Status {
    let msg = e.to_string();
    match e {
        CoreError::Store(s) => match s {
            StoreError::Header { .. }
            | StoreError::NotAFile { .. }
            | StoreError::DuplicateTensor { .. }
            | StoreError::NotInFiles { .. }
            | StoreError::SelectedScale { .. }
            | StoreError::TooManyTensors { .. }
            | StoreError::DescriptionTooLarge { .. }
            | StoreError::Quantize(_)
            | StoreError::Scale { .. } => Status::invalid_argument(msg),
            StoreError::Io { .. }
            | StoreError::UploadMapped(_)
            | StoreError::UploadSealsClosed(_) => Status::failed_precondition(msg),
            StoreError::Seal { .. } => Status::internal(msg),
            StoreError::Arena { .. }
            | StoreError::UploadTooLarge { .. }
            | StoreError::TooManyUploads { .. }
            | StoreError::TooManyStateRegions { .. } => Status::resource_exhausted(msg),
            StoreError::UnknownModel(_)
            | StoreError::UnknownUpload(_)
            | StoreError::UnknownStateRegion(_)
            | StoreError::NotHolder { .. } => Status::not_found(msg),
            StoreError::NotOwner(_) => Status::permission_denied(msg),
            StoreError::Quota(_) | StoreError::HostFull(_) => Status::resource_exhausted(msg),
            StoreError::Pin(_) => Status::resource_exhausted(msg),
        },
        CoreError::Layout(_) | CoreError::Budget(_) | CoreError::FdToken(_) => {
            Status::invalid_argument(msg)
        }
        CoreError::Backend(BackendError::Alloc { .. }) => Status::resource_exhausted(msg),
        CoreError::Backend(_) | CoreError::Residency(_) => Status::internal(msg),
        CoreError::UnknownSession(_) | CoreError::UnknownDevice(_) => Status::not_found(msg),
        CoreError::NotOwner(_) | CoreError::NotAdministrator { .. } => {
            Status::permission_denied(msg)
        }
        CoreError::Quota(_) => Status::resource_exhausted(msg),
        CoreError::ShuttingDown => Status::unavailable(msg),
    }
}

/// The gRPC status for a refused attach.
pub fn attach_status(e: &AttachError) -> Status {
    match e {
        AttachError::AlreadyAttached(_) => Status::failed_precondition(e.to_string()),
    }
}
