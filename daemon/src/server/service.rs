//! The `weightstream.v1.WeightStream` service: each handler takes the peer, validates the
//! request into its `Valid…` type, calls the core and converts the answer.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use weightstream_proto::v1 as pb;
use weightstream_proto::v1::weight_stream_server::WeightStream;

use super::blocking::BlockingTasks;
use super::conn::Caller;
use super::convert::{self, manifest, session_info, stored_manifest};
use super::error::EdgeError;
use super::heap;
use super::validate::{PageList, Validation};
use crate::core::{Daemon, Peer, shown_name};
use crate::session::CloseReason;
use crate::store::LoadSource;

pub struct Service {
    daemon: Arc<Daemon>,
    validation: Validation,
    /// Loads and commits run here, by name, so that a stop can say which it abandoned.
    blocking: BlockingTasks,
}

impl Service {
    pub fn new(daemon: Arc<Daemon>, blocking: BlockingTasks) -> Self {
        let validation = Validation::new(&daemon.config.limits);
        Service {
            daemon,
            validation,
            blocking,
        }
    }
}

fn peer<T>(req: &Request<T>) -> Result<Peer, Status> {
    let caller = req.extensions().get::<Caller>();
    caller
        .map(|c| c.peer)
        .ok_or_else(|| EdgeError::NoPeer.into())
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// One line per load or commit: the model, and where the time went.
fn log_stored(what: &'static str, stored: &crate::store::Stored) {
    let (m, p) = (&stored.model, &stored.phases);
    tracing::info!(
        model = %m.id,
        name = %m.name,
        existed = stored.existed,
        bytes = m.total_bytes,
        quantization = %m.quantization(),
        input_bytes = p.input_bytes,
        secs = p.total.as_secs_f64(),
        gb_per_s = p.gb_per_s(),
        alloc_secs = p.alloc.as_secs_f64(),
        read_secs = p.read.as_secs_f64(),
        seal_secs = p.seal.as_secs_f64(),
        quantize_secs = p.quantize.as_secs_f64(),
        code_secs = p.code.as_secs_f64(),
        hash_secs = p.hash.as_secs_f64(),
        pin_secs = p.pin.as_secs_f64(),
        "{what}"
    );
}

/// The manifests that fit in `room` bytes, in order, and whether some were left for the next
/// page. The first always goes in: the store admits no model whose manifest could not.
fn fill_page(
    manifests: impl Iterator<Item = pb::ModelManifest>,
    room: u64,
) -> (Vec<pb::ModelManifest>, bool) {
    use prost::Message;
    let mut page = Vec::new();
    let mut used = 0u64;
    for m in manifests {
        // As a repeated field: a tag byte, the length's varint, the message.
        let len = m.encoded_len() as u64;
        let size = 1 + prost::length_delimiter_len(len as usize) as u64 + len;
        if !page.is_empty() && used + size > room {
            return (page, true);
        }
        used += size;
        page.push(m);
    }
    (page, false)
}

#[tonic::async_trait]
impl WeightStream for Service {
    async fn get_info(
        &self,
        req: Request<pb::GetInfoRequest>,
    ) -> Result<Response<pb::GetInfoResponse>, Status> {
        let peer = peer(&req)?;
        Ok(Response::new(convert::info(&self.daemon, peer.uid)))
    }

    type LoadModelStream = EventStream<pb::LoadModelEvent>;

    async fn load_model(
        &self,
        req: Request<pb::LoadModelRequest>,
    ) -> Result<Response<Self::LoadModelStream>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.load_model(req.into_inner())?;
        let uid = peer.uid;
        let what = match req.paths.as_slice() {
            [one] => format!("LoadModel of {one} for uid {uid}"),
            [first, rest @ ..] => format!(
                "LoadModel of {first} and {} more files for uid {uid}",
                rest.len()
            ),
            [] => format!("LoadModel for uid {uid}"),
        };
        let sources = (self.daemon).load_sources(&peer, &req.fd_token, req.paths)?;
        let daemon = self.daemon.clone();
        let (tx, rx) = mpsc::channel(16);
        self.blocking.spawn(what, move || {
            let sources: Vec<_> = (sources.into_iter())
                .map(|s| LoadSource {
                    name: shown_name(&s.name, &s.file),
                    file: s.file,
                })
                .collect();
            let progress_tx = tx.clone();
            let mut progress = |done: u64, total: u64, file: &std::path::Path| {
                let event = pb::load_model_event::Event::Progress(pb::LoadProgress {
                    bytes_done: done,
                    bytes_total: total,
                    current_file: file.display().to_string(),
                });
                let _ = progress_tx.blocking_send(Ok(pb::LoadModelEvent { event: Some(event) }));
            };
            let result = daemon.store.load_coded(
                &sources,
                &req.name,
                (req.quantization, req.coding),
                &req.tensors,
                (peer.owner(), req.retention),
                &mut progress,
            );
            let msg = result
                .map(|stored| {
                    log_stored("model loaded", &stored);
                    let entry = daemon.store.get(&stored.model.id);
                    let event = pb::load_model_event::Event::Manifest(stored_manifest(
                        &stored,
                        entry.as_ref(),
                    ));
                    pb::LoadModelEvent { event: Some(event) }
                })
                .map_err(Status::from);
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
        self.validation.begin_upload_bounds(&req)?;
        let (daemon, validation) = (self.daemon.clone(), self.validation);
        let what = format!(
            "BeginUpload of {} tensors for uid {}",
            req.tensors.len(),
            peer.uid
        );
        // Blocking: a request may declare a million tensors, checked one by one (other peers'
        // requests must not queue behind that on the async threads), and the region's pages
        // are reserved here (seconds for tens of GB).
        let (ticket, secret) = self
            .blocking
            .spawn(what, move || {
                let tensors = req.tensors.len();
                let begun = validation
                    .begin_upload(req)
                    .map_err(Status::from)
                    .and_then(|req| {
                        (daemon.begin_upload(&peer, &req.name, req.tensors, req.pages))
                            .map_err(Status::from)
                    });
                if tensors >= heap::LARGE_REQUEST_TENSORS {
                    // The request and its checked copy are freed by now.
                    heap::give_back_free_memory();
                }
                begun
            })
            .await
            .map_err(|source| EdgeError::Task {
                what: "begin upload",
                source,
            })??;
        Ok(Response::new(convert::upload_begun(ticket, secret)))
    }

    async fn commit_upload(
        &self,
        req: Request<pb::CommitUploadRequest>,
    ) -> Result<Response<pb::CommitUploadResponse>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.commit_upload(req.into_inner())?;
        let daemon = self.daemon.clone();
        let what = format!("CommitUpload '{}' for uid {}", req.upload_id, peer.uid);
        let stored = self
            .blocking
            .spawn(what, move || {
                daemon.commit_upload(&peer, &req.upload_id, req.retention, req.coding)
            })
            .await
            .map_err(|source| EdgeError::Task {
                what: "commit",
                source,
            })??;
        log_stored("upload committed", &stored);
        let entry = self.daemon.store.get(&stored.model.id);
        Ok(Response::new(pb::CommitUploadResponse {
            manifest: Some(stored_manifest(&stored, entry.as_ref())),
            deduplicated: stored.existed,
        }))
    }

    async fn abort_upload(
        &self,
        req: Request<pb::AbortUploadRequest>,
    ) -> Result<Response<pb::AbortUploadResponse>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.abort_upload(req.into_inner())?;
        (self.daemon).abort_upload(&peer, &req.upload_id)?;
        Ok(Response::new(pb::AbortUploadResponse {}))
    }

    async fn release_model(
        &self,
        req: Request<pb::ReleaseModelRequest>,
    ) -> Result<Response<pb::ReleaseModelResponse>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.release_model(req.into_inner())?;
        let refcount = (self.daemon).release_model(&peer, &req.model_id, req.all_references)?;
        Ok(Response::new(pb::ReleaseModelResponse { refcount }))
    }

    async fn list_models(
        &self,
        req: Request<pb::ListModelsRequest>,
    ) -> Result<Response<pb::ListModelsResponse>, Status> {
        let page = self.validation.list_models(req.into_inner())?;
        let store = &self.daemon.store;
        let (entries, more) = store.models_page(&page.after, page.size);
        let room = (self.daemon.config.limits.max_message_bytes)
            .saturating_sub(crate::store::MESSAGE_ENVELOPE);
        let (models, cut) = fill_page(entries.iter().map(|e| manifest(&e.model, Some(e))), room);
        let next_page_token = match models.last() {
            Some(last) if more || cut => {
                (self.validation).page_token(PageList::Models, &last.model_id)
            }
            _ => String::new(),
        };
        Ok(Response::new(pb::ListModelsResponse {
            models,
            store_bytes: store.bytes(),
            next_page_token,
        }))
    }

    async fn open_session(
        &self,
        req: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.open_session(req.into_inner())?;
        let opened = self.daemon.open_session(peer, req).await?;
        Ok(Response::new(convert::opened(&opened)))
    }

    async fn close_session(
        &self,
        req: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.close_session(req.into_inner())?;
        let session = self.daemon.owned_session(&peer, &req.session_id)?;
        session.close(CloseReason::ClientClosed).await;
        Ok(Response::new(pb::CloseSessionResponse {}))
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let page = self.validation.list_sessions(req.into_inner())?;
        let (sessions, more) = self.daemon.sessions_page(page.after, page.size);
        let next_page_token = match sessions.last() {
            Some(last) if more => {
                let position = last.shared.number.to_string();
                (self.validation).page_token(PageList::Sessions, &position)
            }
            _ => String::new(),
        };
        let state = self.daemon.store.state_use();
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: (sessions.iter())
                .map(|s| {
                    let used = state.get(&s.shared.id).copied().unwrap_or_default();
                    session_info(&s.owner, &s.shared, used)
                })
                .collect(),
            next_page_token,
        }))
    }

    async fn alloc_state_region(
        &self,
        req: Request<pb::AllocStateRegionRequest>,
    ) -> Result<Response<pb::AllocStateRegionResponse>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.alloc_state_region(req.into_inner())?;
        let daemon = self.daemon.clone();
        let what = format!(
            "AllocStateRegion of {} bytes for session '{}' of uid {}",
            req.bytes, req.session_id, peer.uid
        );
        // Blocking: making room may evict cached models (their arenas unpinned as they go).
        let (ticket, fd_secret) = self
            .blocking
            .spawn(what, move || {
                daemon.alloc_state_region(&peer, &req.session_id, req.bytes.get(), &req.label)
            })
            .await
            .map_err(|source| EdgeError::Task {
                what: "allocate state region",
                source,
            })??;
        Ok(Response::new(pb::AllocStateRegionResponse {
            region_id: ticket.region_id,
            size: ticket.size,
            fd_secret,
        }))
    }

    async fn free_state_region(
        &self,
        req: Request<pb::FreeStateRegionRequest>,
    ) -> Result<Response<pb::FreeStateRegionResponse>, Status> {
        let peer = peer(&req)?;
        let req = self.validation.free_state_region(req.into_inner())?;
        (self.daemon).free_state_region(&peer, &req.session_id, &req.region_id)?;
        Ok(Response::new(pb::FreeStateRegionResponse {}))
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
