//! Group layouts and the split of a session's budget into staging and resident bytes.

use std::collections::HashMap;

use crate::config::ResidentPlacement;
use crate::mem::align_up;
use crate::store::Model;

/// Where each tensor of a group sits, relative to the group's start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPlacement {
    pub name: String,
    /// (tensor index in the model, offset from the group's start)
    pub tensors: Vec<(usize, u64)>,
    /// Bytes the group takes, tensor alignment included.
    pub nbytes: u64,
    /// Tensor names joined: the group's identity across sessions.
    pub key: String,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("groups: none declared")]
    NoGroups,
    #[error("groups[{index}] ('{group}'): no tensors")]
    EmptyGroup { index: usize, group: String },
    #[error("groups[{index}] ('{group}'): tensor '{tensor}' is not in the model")]
    UnknownTensor {
        index: usize,
        group: String,
        tensor: String,
    },
    #[error("groups[{index}] ('{group}'): tensor '{tensor}' is already in group '{other}'")]
    TensorTwice {
        index: usize,
        group: String,
        tensor: String,
        other: String,
    },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BudgetError {
    #[error(
        "vram_budget {budget} is smaller than the largest group '{group}' ({bytes} bytes, aligned)"
    )]
    BudgetTooSmall {
        budget: u64,
        group: String,
        bytes: u64,
    },
    #[error("staging_bytes {staging} is smaller than the largest group '{group}' ({bytes} bytes)")]
    StagingTooSmall {
        staging: u64,
        group: String,
        bytes: u64,
    },
    #[error("staging_bytes {staging} exceeds vram_budget {budget}")]
    StagingOverBudget { staging: u64, budget: u64 },
}

pub fn layout_groups(
    model: &Model,
    specs: &[(String, Vec<String>)],
    align: u64,
) -> Result<Vec<GroupPlacement>, LayoutError> {
    if specs.is_empty() {
        return Err(LayoutError::NoGroups);
    }
    let mut owner: HashMap<&str, &str> = HashMap::new();
    let mut groups = Vec::with_capacity(specs.len());
    for (index, (name, tensors)) in specs.iter().enumerate() {
        if tensors.is_empty() {
            return Err(LayoutError::EmptyGroup {
                index,
                group: name.clone(),
            });
        }
        let mut placed = Vec::with_capacity(tensors.len());
        let mut end = 0u64;
        for tensor in tensors {
            let t = model
                .tensor_index(tensor)
                .ok_or_else(|| LayoutError::UnknownTensor {
                    index,
                    group: name.clone(),
                    tensor: tensor.clone(),
                })?;
            if let Some(other) = owner.insert(tensor, name) {
                return Err(LayoutError::TensorTwice {
                    index,
                    group: name.clone(),
                    tensor: tensor.clone(),
                    other: other.to_string(),
                });
            }
            let at = align_up(end, align);
            end = at + model.tensors[t].nbytes;
            placed.push((t, at));
        }
        groups.push(GroupPlacement {
            name: name.clone(),
            tensors: placed,
            nbytes: align_up(end.max(1), align),
            key: tensors.join("\n"),
        });
    }
    Ok(groups)
}

/// The staging size and which groups stay resident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetSplit {
    pub staging_bytes: u64,
    pub resident: Vec<bool>,
    pub resident_bytes: u64,
}

/// Staging gets what was asked, or by default a quarter of the budget but at least three of the
/// largest group (double buffering plus one for a re-acquire), capped by the budget. Resident
/// groups fill the rest as `placement` says ([`resident_groups`]).
pub fn split_budget(
    groups: &[GroupPlacement],
    budget: u64,
    staging_request: u64,
    align: u64,
    placement: ResidentPlacement,
) -> Result<BudgetSplit, BudgetError> {
    let largest = groups
        .iter()
        .max_by_key(|g| g.nbytes)
        .expect("layout_groups refuses empty group lists");
    if budget < largest.nbytes {
        return Err(BudgetError::BudgetTooSmall {
            budget,
            group: largest.name.clone(),
            bytes: largest.nbytes,
        });
    }
    let staging = if staging_request == 0 {
        (budget / 4).max(3 * largest.nbytes).min(budget)
    } else if staging_request < largest.nbytes {
        return Err(BudgetError::StagingTooSmall {
            staging: staging_request,
            group: largest.name.clone(),
            bytes: largest.nbytes,
        });
    } else if staging_request > budget {
        return Err(BudgetError::StagingOverBudget {
            staging: staging_request,
            budget,
        });
    } else {
        staging_request
    };
    let staging = align_up(staging, align).min(budget);
    let resident = resident_groups(groups, budget - staging, placement);
    let resident_bytes = groups
        .iter()
        .zip(&resident)
        .filter(|(_, r)| **r)
        .map(|(g, _)| g.nbytes)
        .sum();
    Ok(BudgetSplit {
        staging_bytes: staging,
        resident,
        resident_bytes,
    })
}

/// Which groups fit in `room` bytes. `First` takes them in declaration order, skipping those
/// that do not fit. `Spread` gives each group its share of the room (room / all groups' bytes of
/// its size) as credit and keeps it resident once the credit carried along reaches half its
/// size, then fills what is left in declaration order: resident groups come at even intervals
/// of the pass (declaration order being the order most models run their blocks), so the copy
/// engine runs ahead while each computes, where resident groups all at the start leave it idle
/// while the staging arena is full.
fn resident_groups(
    groups: &[GroupPlacement],
    room: u64,
    placement: ResidentPlacement,
) -> Vec<bool> {
    let mut left = room;
    let mut resident = vec![false; groups.len()];
    let mut take = |i: usize, left: &mut u64| {
        let fits = !resident[i] && groups[i].nbytes <= *left;
        if fits {
            *left -= groups[i].nbytes;
            resident[i] = true;
        }
        fits
    };
    if placement == ResidentPlacement::Spread {
        let total: u128 = groups.iter().map(|g| u128::from(g.nbytes)).sum();
        // Credit in units of 1 / total bytes: a group of n bytes earns n × room.
        let mut credit: i128 = 0;
        for (i, g) in groups.iter().enumerate() {
            let n = i128::from(g.nbytes);
            credit += n * i128::from(room);
            if 2 * credit >= n * total as i128 && take(i, &mut left) {
                credit -= n * total as i128;
            }
        }
    }
    for i in 0..groups.len() {
        take(i, &mut left);
    }
    resident
}

#[cfg(test)]
mod tests {
    use super::*;
    use ResidentPlacement::{First, Spread};

    fn group(name: &str, nbytes: u64) -> GroupPlacement {
        GroupPlacement {
            name: name.into(),
            tensors: vec![],
            nbytes,
            key: name.into(),
        }
    }

    #[test]
    fn default_split_keeps_a_quarter_or_three_largest_for_staging() {
        let groups: Vec<_> = (0..8).map(|i| group(&format!("g{i}"), 1024)).collect();
        let s = split_budget(&groups, 16 * 1024, 0, 256, First).unwrap();
        assert_eq!(s.staging_bytes, 4096);
        assert_eq!(s.resident, [true; 8]);
        assert_eq!(s.resident_bytes, 8192);
        let s = split_budget(&groups, 6 * 1024, 0, 256, First).unwrap();
        assert_eq!(s.staging_bytes, 3072);
        assert_eq!(
            s.resident,
            [true, true, true, false, false, false, false, false]
        );
        let s = split_budget(&groups, 1024, 0, 256, First).unwrap();
        assert_eq!((s.staging_bytes, s.resident_bytes), (1024, 0));
    }

    fn resident_indices(s: &BudgetSplit) -> Vec<usize> {
        (s.resident.iter().enumerate())
            .filter_map(|(i, r)| r.then_some(i))
            .collect()
    }

    #[test]
    fn spread_keeps_resident_groups_at_even_intervals() {
        let groups: Vec<_> = (0..12).map(|i| group(&format!("g{i}"), 1024)).collect();
        // Staging of three groups, three more resident: one in every four.
        let s = split_budget(&groups, 6 * 1024, 3 * 1024, 256, Spread).unwrap();
        assert_eq!(resident_indices(&s), [1, 5, 9]);
        assert_eq!(s.resident_bytes, 3 * 1024);
        let s = split_budget(&groups, 6 * 1024, 3 * 1024, 256, First).unwrap();
        assert_eq!(resident_indices(&s), [0, 1, 2]);
        // Room for all: all, either way.
        let s = split_budget(&groups, 16 * 1024, 0, 256, Spread).unwrap();
        assert_eq!(s.resident, [true; 12]);
    }

    #[test]
    fn spread_fills_the_room_with_groups_of_mixed_sizes() {
        // FLUX.1-dev's 8-bit blocks in MiB: small embedders, 19 double blocks, 38 single ones.
        let mut groups: Vec<_> = (0..7).map(|i| group(&format!("e{i}"), 8)).collect();
        groups.extend((0..19).map(|i| group(&format!("d{i}"), 344)));
        groups.extend((0..38).map(|i| group(&format!("s{i}"), 136)));
        let s = split_budget(&groups, 1936, 1032, 8, Spread).unwrap();
        // Double block 6, single blocks 0, 4, 17 and 30; two embedders fill the room exactly.
        assert_eq!(resident_indices(&s), [0, 6, 13, 26, 30, 43, 56]);
        assert_eq!(s.resident_bytes, 904);
        let s = split_budget(&groups, 1936, 1032, 8, First).unwrap();
        assert_eq!(resident_indices(&s), [0, 1, 2, 3, 4, 5, 6, 7, 8, 26]);
        assert_eq!(s.resident_bytes, 7 * 8 + 2 * 344 + 136);
    }

    #[test]
    fn budget_errors_name_the_field_and_limit() {
        let groups = vec![group("small", 256), group("big", 4096)];
        let e = split_budget(&groups, 1000, 0, 256, Spread).unwrap_err();
        assert_eq!(
            e.to_string(),
            "vram_budget 1000 is smaller than the largest group 'big' (4096 bytes, aligned)"
        );
        let e = split_budget(&groups, 8192, 1024, 256, Spread).unwrap_err();
        assert!(matches!(
            e,
            BudgetError::StagingTooSmall { staging: 1024, .. }
        ));
        let e = split_budget(&groups, 8192, 9000, 256, Spread).unwrap_err();
        assert_eq!(
            e,
            BudgetError::StagingOverBudget {
                staging: 9000,
                budget: 8192
            }
        );
        let s = split_budget(&groups, 8192, 4096, 256, Spread).unwrap();
        assert_eq!(s.resident, [true, false]);
    }
}
