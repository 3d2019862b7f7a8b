//! `weightstream release`: gives back one of this uid's references to a model, or, as root or
//! the daemon's user, every uid's (`--all`). A reference is the uid's, not the connection's: a
//! model that `weightstream load` loaded stays after the command exits (as a cache entry the
//! daemon evicts when it needs the memory, or pinned with `--pin`) until its uid releases it;
//! the model leaves the store once no uid holds a reference and no session uses it. The model
//! is named by its id or by its name, when one model has that name.
#![forbid(unsafe_code)]

use std::path::PathBuf;

use weightstream_client::{Client, proto};

use super::{CliResult, Deadline, shown};

#[derive(Debug, clap::Args)]
pub struct ReleaseArgs {
    /// The model: its id (m- and 32 hex digits) or its name, as `weightstream load` and
    /// `weightstream status` print them.
    model: String,
    /// Give back every uid's references, pins included (root and the daemon's user only):
    /// frees a model that others loaded; it goes once its sessions end.
    #[arg(long)]
    all: bool,
}

pub async fn run(socket: Option<PathBuf>, args: ReleaseArgs, deadline: Deadline) -> CliResult {
    let connect = Client::connect(socket.as_deref());
    let mut client = deadline.on("connecting", connect).await?;
    let listed = deadline.on("ListModels", client.list_models()).await?;
    let (id, shown_as) = which(&listed.models, &args.model)?;
    if args.all {
        let release = client.release_model_for_all(&id);
        deadline.on("ReleaseModel", release).await?;
        out!("{shown_as}  released for every uid  (it leaves the store once no session uses it)");
        return Ok(());
    }
    let left = (deadline.on("ReleaseModel", client.release_model(&id))).await?;
    let fate = if left == 0 {
        "no references left: it leaves the store once no session uses it"
    } else {
        "other references keep it"
    };
    out!("{shown_as}  released  (references left: {left}; {fate})");
    Ok(())
}

/// The id of the model that `given` names (its id, or the name of exactly one model) and how
/// the output shows it; an error that says which models a name could mean, or that none has
/// that id or name. What looks like an id (`m-…`) and names no model goes to the daemon as
/// it is, whose answer does not say whether another uid's model exists.
fn which(models: &[proto::ModelManifest], given: &str) -> Result<(String, String), String> {
    let named_so = |m: &&proto::ModelManifest| m.name == given;
    let is_id = models.iter().any(|m| m.model_id == given);
    if is_id || (given.starts_with("m-") && !models.iter().any(|m| named_so(&m))) {
        return Ok((given.to_string(), shown(given)));
    }
    let named: Vec<&proto::ModelManifest> = models.iter().filter(named_so).collect();
    match named.as_slice() {
        [m] => Ok((
            m.model_id.clone(),
            format!("{} ({})", shown(given), shown(&m.model_id)),
        )),
        [] => Err(format!(
            "no model has the id or the name '{}' (`weightstream status` lists the models)",
            shown(given)
        )),
        several => Err(format!(
            "{} models are named '{}': give the id of the one to release ({})",
            several.len(),
            shown(given),
            several
                .iter()
                .map(|m| shown(&m.model_id))
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}
