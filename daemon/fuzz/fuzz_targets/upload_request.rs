//! Any bytes as a BeginUpload request, decoded by prost and handed to the service's validation
//! layer: it accepts or names the field, never panics; what it accepts has sizes that add up.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use weightstream_daemon::config::Limits;
use weightstream_daemon::server::validate::Validation;
use weightstream_daemon::store::DeclQuant;
use weightstream_proto::v1 as proto;

fuzz_target!(|data: &[u8]| {
    let Ok(req) = proto::BeginUploadRequest::decode(data) else {
        return;
    };
    let validation = Validation::new(&Limits::default());
    if let Err(e) = validation.begin_upload(req.clone()) {
        let message = e.to_string();
        assert!(message.starts_with("name: ") || message.starts_with("tensors"));
    }
    // The tensors whatever the name: an empty name is valid, so only they are checked here.
    let unnamed = proto::BeginUploadRequest {
        name: String::new(),
        ..req.clone()
    };
    match validation.begin_upload(unnamed) {
        Ok(valid) => {
            assert_eq!(valid.tensors.len(), req.tensors.len());
            for (decl, t) in valid.tensors.iter().zip(&req.tensors) {
                let elems = decl.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
                let written = elems.and_then(|e| e.checked_mul(decl.dtype.size()));
                match &decl.quant {
                    // Written as declared (and quantized at commit, or kept): dtype × shape.
                    DeclQuant::None | DeclQuant::AtCommit(_) => {
                        assert_eq!(written, Some(decl.nbytes))
                    }
                    // Written as data, padding and scales, data first: the scales start after
                    // the data (dtype × shape) and end within the declared size.
                    DeclQuant::Prequantized(layout) => {
                        let data = written.expect("a valid tensor's data size fits in u64");
                        assert!(layout.scale_offset >= data);
                        assert!(decl.nbytes >= layout.scale_offset);
                    }
                }
                assert!(t.nbytes == 0 || t.nbytes == decl.nbytes);
            }
        }
        Err(e) => assert!(e.to_string().starts_with("tensors"), "{e}"),
    }
});
