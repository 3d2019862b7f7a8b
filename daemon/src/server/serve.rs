//! The gRPC server on the socket: health, reflection (v1, and v1alpha for grpcio-reflection,
//! which speaks nothing else) and the weightstream service behind the access check, served on
//! the accepted connections until shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tonic::service::Routes;
use tonic::service::interceptor::InterceptedService;
use tonic_health::server::HealthReporter;
use tonic_reflection::server::Builder as Reflection;
use weightstream_proto::v1::FILE_DESCRIPTOR_SET;
use weightstream_proto::v1::weight_stream_server::WeightStreamServer;

use super::access::AccessCheck;
use super::blocking::BlockingTasks;
use super::conn::{self, Connections};
use super::error::ServeError;
use super::service::Service;
use crate::core::Daemon;

/// The weightstream service as tonic serves it (health reports its status by this type).
pub(super) type Api = WeightStreamServer<Service>;

/// An idle connection is pinged this often, and closed when a ping is not answered within
/// [`KEEPALIVE_TIMEOUT`] (a peer that vanished without closing its socket).
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Every service on the socket, and the reporter of their health (SERVING from here on).
pub(super) async fn routes(
    daemon: &Arc<Daemon>,
    blocking: &BlockingTasks,
) -> Result<(Routes, HealthReporter), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<Api>().await;
    let reflection = || {
        Reflection::configure()
            .register_encoded_file_descriptor_set(FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let max_message = daemon.config.limits.max_message_bytes as usize;
    let api = Api::new(Service::new(daemon.clone(), blocking.clone()))
        .max_decoding_message_size(max_message)
        .max_encoding_message_size(max_message);
    // Every call of the service passes the allow-lists first; health and reflection do not
    // (see access.rs).
    let api = InterceptedService::new(api, AccessCheck::new(&daemon.config.access));
    let routes = Routes::new(health_service)
        .add_service(reflection().build_v1()?)
        .add_service(reflection().build_v1alpha()?)
        .add_service(api);
    Ok((routes, health))
}

/// Serves `routes` on `listener` until `shutdown` resolves and the open connections end; each
/// closed connection is reported to the daemon (its sessions and uploads go with it).
pub(super) async fn serve(
    routes: Routes,
    listener: UnixListener,
    daemon: Arc<Daemon>,
    connections: Arc<Connections>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let (closed_tx, mut closed_rx) = mpsc::unbounded_channel::<u64>();
    tokio::spawn(async move {
        while let Some(conn) = closed_rx.recv().await {
            let d = daemon.clone();
            tokio::spawn(async move { d.connection_closed(conn).await });
        }
    });
    tonic::transport::Server::builder()
        // One span per request; the session actor adds its own per session. At warn level, so
        // that a warning (a refused peer) names its method under WEIGHTSTREAM_LOG=warn too.
        .trace_fn(|req| tracing::warn_span!("request", method = %req.uri().path()))
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .add_routes(routes)
        .serve_with_incoming_shutdown(conn::incoming(listener, closed_tx, connections), shutdown)
        .await?;
    Ok(())
}
