//! The weightstream daemon's wire, shared by the daemon and its clients: the gRPC messages and
//! services generated from `weightstream/v1/weightstream.proto` ([`v1`]), the handoff socket's
//! framing ([`handoff`], both halves) and where the daemon's socket is ([`socket`]). Neither side
//! depends on the other: both depend on this crate.
#![forbid(unsafe_code)]

pub mod handoff;
pub mod socket;

/// The generated code of the package `weightstream.v1` (client and server), and its descriptor
/// set, which the daemon serves through gRPC reflection.
pub mod v1 {
    tonic::include_proto!("weightstream.v1");
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("weightstream_descriptor");
}
