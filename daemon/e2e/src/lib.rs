//! The daemon end to end (crate `weightstream-e2e`): its tests, under `tests/`, start the daemon
//! in process on a temporary socket and drive it through `weightstream-client`, raw gRPC and the
//! handoff socket, as a trainer and as another uid would. The library is empty: the crate exists
//! so that `weightstream-daemon` needs no client crate, not even as a dev-dependency.
