pub mod proto {
    tonic::include_proto!("weightstream.v1");
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("weightstream_descriptor");
}
