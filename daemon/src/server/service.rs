//! The `weightstream.v1.WeightStream` service: peer identity, validation, mapping to the core.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use weightstream_client::proto as pb;
use weightstream_client::proto::weight_stream_server::WeightStream;

use super::conn::Peer;
use super::convert::{dtype_from_pb, manifest, session_info, status_of};
use super::validate::{Check, check_name, check_upload_tensors};
use crate::core::{Daemon, OpenRequest};
use crate::session::CloseReason;
use crate::store::Owner;

pub struct Service {
    daemon: Arc<Daemon>,
}

impl Service {
    pub fn new(daemon: Arc<Daemon>) -> Self {
        Service { daemon }
    }

    fn check(&self) -> Check {
        Check::new(&self.daemon.config.limits)
    }
}

fn peer<T>(req: &Request<T>) -> Result<Peer, Status> {
    req.extensions()
        .get::<Peer>()
        .copied()
        .ok_or_else(|| Status::internal("connection without peer credentials"))
}

fn owner(peer: Peer) -> Owner {
    Owner {
        conn: peer.conn,
        uid: peer.uid,
    }
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl WeightStream for Service {
    async fn get_info(
        &self,
        _req: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        let d = &self.daemon;
        let l = &d.config.limits;
        Ok(Response::new(pb::GetInfoResponse {
            version: env!("CARGO_PKG_VERSION").to_string(),
            backend: match d.backend.kind() {
                crate::backend::BackendKind::Host => pb::Backend::Host,
                crate::backend::BackendKind::Cuda => pb::Backend::Cuda,
            } as i32,
            devices: d
                .backend
                .devices()
                .into_iter()
                .map(|x| pb::Device {
                    uuid: x.uuid,
                    name: x.name,
                    total_memory: x.total_memory,
                    free_memory: x.free_memory,
                    pci_bus_id: x.pci_bus_id,
                })
                .collect(),
            limits: Some(pb::Limits {
                max_message_bytes: l.max_message_bytes.as_u64(),
                max_tensors_per_model: l.max_tensors_per_model,
                max_groups_per_session: l.max_groups_per_session,
                max_plan_length: l.max_plan_length,
                max_live_tickets: l.max_live_tickets,
                max_upload_bytes: l.max_upload_bytes.as_u64(),
                max_sessions: l.max_sessions,
                max_name_bytes: l.max_name_bytes,
            }),
            alignment: d.backend.alignment(),
        }))
    }

    type LoadModelStream = EventStream<pb::LoadModelEvent>;

    async fn load_model(
        &self,
        req: Request<pb::LoadModelRequest>,
    ) -> Result<Response<Self::LoadModelStream>, Status> {
        let uid = peer(&req)?.uid;
        let req = req.into_inner();
        let check = self.check();
        check.count("paths", req.paths.len(), 1, 4096)?;
        for (i, p) in req.paths.iter().enumerate() {
            check.text(&format!("paths[{i}]"), p, 4096)?;
        }
        check_name(&check, "name", &req.name)?;
        let daemon = self.daemon.clone();
        let (tx, rx) = mpsc::channel(16);
        tokio::task::spawn_blocking(move || {
            let paths: Vec<PathBuf> = req.paths.iter().map(PathBuf::from).collect();
            let progress_tx = tx.clone();
            let mut progress = |done: u64, total: u64, file: &std::path::Path| {
                let event = pb::load_model_event::Event::Progress(pb::LoadProgress {
                    bytes_done: done,
                    bytes_total: total,
                    current_file: file.display().to_string(),
                });
                let _ = progress_tx.blocking_send(Ok(pb::LoadModelEvent { event: Some(event) }));
            };
            let result = daemon.store.load(&paths, &req.name, uid, &mut progress);
            let msg = result
                .map(|(model, existed)| {
                    tracing::info!(model = %model.id, existed, bytes = model.total_bytes, "model loaded");
                    let entry = daemon.store.get(&model.id);
                    let event = pb::load_model_event::Event::Manifest(manifest(&model, entry.as_ref()));
                    pb::LoadModelEvent { event: Some(event) }
                })
                .map_err(|e| status_of(&e.into()));
            let _ = tx.blocking_send(msg);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn begin_upload(
        &self,
        req: Request<pb::BeginUploadRequest>,
    ) -> Result<Response<pb::BeginUploadResponse>, Status> {
        let peer = peer(&req)?;
        let req = req.into_inner();
        let check = self.check();
        check_name(&check, "name", &req.name)?;
        let tensors = check_upload_tensors(&check, &req.tensors)?;
        let ticket = self
            .daemon
            .store
            .begin_upload(owner(peer), &req.name, tensors)
            .map_err(|e| status_of(&e.into()))?;
        Ok(Response::new(pb::BeginUploadResponse {
            upload_id: ticket.upload_id,
            shm_path: ticket.path.display().to_string(),
            size: ticket.size,
            tensors: ticket
                .tensors
                .into_iter()
                .map(|t| pb::UploadTensor {
                    name: t.name,
                    offset: t.offset,
                    nbytes: t.nbytes,
                })
                .collect(),
        }))
    }

    async fn commit_upload(
        &self,
        req: Request<pb::CommitUploadRequest>,
    ) -> Result<Response<pb::CommitUploadResponse>, Status> {
        let peer = peer(&req)?;
        let req = req.into_inner();
        self.check().text("upload_id", &req.upload_id, 256)?;
        let daemon = self.daemon.clone();
        let (model, deduplicated) = tokio::task::spawn_blocking(move || {
            daemon.store.commit_upload(owner(peer), &req.upload_id)
        })
        .await
        .map_err(|e| Status::internal(format!("commit task failed: {e}")))?
        .map_err(|e| status_of(&e.into()))?;
        let entry = self.daemon.store.get(&model.id);
        Ok(Response::new(pb::CommitUploadResponse {
            manifest: Some(manifest(&model, entry.as_ref())),
            deduplicated,
        }))
    }

    async fn release_model(
        &self,
        req: Request<pb::ReleaseModelRequest>,
    ) -> Result<Response<pb::ReleaseModelResponse>, Status> {
        let uid = peer(&req)?.uid;
        let req = req.into_inner();
        self.check().text("model_id", &req.model_id, 256)?;
        let refcount = self
            .daemon
            .store
            .release(&req.model_id, uid)
            .map_err(|e| status_of(&e.into()))?;
        Ok(Response::new(pb::ReleaseModelResponse { refcount }))
    }

    async fn list_models(
        &self,
        _req: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let store = &self.daemon.store;
        Ok(Response::new(pb::ListModelsResponse {
            models: store
                .models()
                .iter()
                .map(|e| manifest(&e.model, Some(e)))
                .collect(),
            store_bytes: store.bytes(),
        }))
    }

    async fn open_session(
        &self,
        req: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        let peer = peer(&req)?;
        let req = req.into_inner();
        let check = self.check();
        check.text("model_id", &req.model_id, 256)?;
        check.text_opt("device_uuid", &req.device_uuid, 256)?;
        check_name(&check, "label", &req.label)?;
        if req.vram_budget == 0 {
            return Err(Status::invalid_argument("vram_budget: must be more than 0"));
        }
        let max_groups = self.daemon.config.limits.max_groups_per_session as usize;
        check.count("groups", req.groups.len(), 1, max_groups)?;
        let max_tensors = self.daemon.config.limits.max_tensors_per_model as usize;
        let mut groups = Vec::with_capacity(req.groups.len());
        for (i, g) in req.groups.into_iter().enumerate() {
            check_name(&check, &format!("groups[{i}].name"), &g.name)?;
            check.count(
                &format!("groups[{i}].tensors"),
                g.tensors.len(),
                1,
                max_tensors,
            )?;
            groups.push((g.name, g.tensors));
        }
        let opened = self
            .daemon
            .open_session(
                peer,
                OpenRequest {
                    model_id: req.model_id,
                    device_uuid: req.device_uuid,
                    vram_budget: req.vram_budget,
                    staging_bytes: req.staging_bytes,
                    groups,
                    label: req.label,
                },
            )
            .await
            .map_err(|e| status_of(&e))?;
        Ok(Response::new(super::convert::opened(&opened)))
    }

    async fn close_session(
        &self,
        req: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let peer = peer(&req)?;
        let req = req.into_inner();
        self.check().text("session_id", &req.session_id, 256)?;
        let session = self
            .daemon
            .owned_session(&peer, &req.session_id)
            .map_err(|e| status_of(&e))?;
        session.close(CloseReason::ClientClosed).await;
        Ok(Response::new(pb::CloseSessionResponse {}))
    }

    async fn list_sessions(
        &self,
        _req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: self
                .daemon
                .list_sessions()
                .iter()
                .map(|s| session_info(&s.owner, &s.shared))
                .collect(),
        }))
    }

    type RunStream = EventStream<pb::ServerMessage>;

    async fn run(
        &self,
        req: Request<Streaming<pb::ClientMessage>>,
    ) -> Result<Response<Self::RunStream>, Status> {
        let peer = peer(&req)?;
        let stream = super::run::run(&self.daemon, peer, req.into_inner()).await?;
        Ok(Response::new(stream))
    }
}

/// Turns an upload tensor's dtype into the store's, naming the field on error.
pub fn upload_dtype(field: &str, dtype: i32) -> Result<crate::store::safetensors::DType, Status> {
    dtype_from_pb(dtype)
        .ok_or_else(|| Status::invalid_argument(format!("{field}: {dtype} is not a known dtype")))
}
