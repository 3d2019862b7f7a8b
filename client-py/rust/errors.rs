//! The one mapping from the Rust client's errors to the Python package's exceptions. The
//! exception classes are Python's (`weightstream.errors`: their constructors and attributes are
//! the package's API); this module decides which one each error is, and with what.

use pyo3::PyErr;
use weightstream_client::{ClientError, Code, HandoffError, proto};

pyo3::import_exception!(weightstream.errors, WeightstreamError);
pyo3::import_exception!(weightstream.errors, DaemonUnavailable);
pyo3::import_exception!(weightstream.errors, RequestRejected);
pyo3::import_exception!(weightstream.errors, SessionFault);

/// The exception for `e`:
/// - the daemon cannot be reached, or a session's stream ended: `DaemonUnavailable`;
/// - the daemon (or the client on its behalf, for paths) refused a request:
///   `RequestRejected(code, message)` with the gRPC code's name (`"NOT_FOUND"`);
/// - the daemon refused one acquire or release: `SessionFault(ticket, code, message)` with the
///   fault code's name (`"FAULT_RESOURCE_EXHAUSTED"`);
/// - anything else (a broken reply, a failed mapping): `WeightstreamError`.
pub(crate) fn to_py(e: ClientError) -> PyErr {
    match e {
        ClientError::Unavailable { .. } => DaemonUnavailable::new_err(e.to_string()),
        ClientError::SessionEnded(reason) => DaemonUnavailable::new_err(reason),
        ClientError::Rejected { code, message } => {
            RequestRejected::new_err((code_name(code), message))
        }
        ClientError::Fault {
            ticket,
            code,
            message,
        } => SessionFault::new_err((ticket, fault_name(code), message)),
        ClientError::Handoff(HandoffError::Refused(message)) => {
            RequestRejected::new_err(("INVALID_ARGUMENT", message))
        }
        ClientError::Handoff(HandoffError::Connect { .. } | HandoffError::Io(_)) => {
            DaemonUnavailable::new_err(e.to_string())
        }
        other => WeightstreamError::new_err(other.to_string()),
    }
}

/// `Result<T, ClientError>` into `PyResult<T>`.
pub(crate) trait IntoPy<T> {
    fn py_err(self) -> pyo3::PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, ClientError> {
    fn py_err(self) -> pyo3::PyResult<T> {
        self.map_err(to_py)
    }
}

pub(crate) fn fault_name(code: proto::FaultCode) -> &'static str {
    code.as_str_name()
}

/// The gRPC status code's canonical name, as grpcio spells it (`StatusCode.NOT_FOUND.name`).
pub(crate) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}
