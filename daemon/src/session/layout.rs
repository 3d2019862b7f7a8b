//! Group layouts and the split of a session's budget into staging and resident bytes.

use std::collections::HashMap;

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
    #[error(
        "vram_budget {budget} exceeds the device's memory ({device} bytes): ask for at most that"
    )]
    OverDevice { budget: u64, device: u64 },
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
/// groups fill the rest, spread along the declaration order ([`resident_groups`]).
pub fn split_budget(
    groups: &[GroupPlacement],
    budget: u64,
    staging_request: u64,
    align: u64,
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
    let resident = resident_groups(groups, budget - staging);
    let resident_bytes = (groups.iter().zip(&resident))
        .filter(|(_, r)| **r)
        .map(|(g, _)| g.nbytes)
        .sum();
    Ok(BudgetSplit {
        staging_bytes: staging,
        resident,
        resident_bytes,
    })
}

/// Which groups fit in `room` bytes, spread along the pass: each group earns its share of the
/// room (room / all groups' bytes, of its size) as credit and is kept once the credit carried
/// along reaches half its size; what is left is then filled in declaration order. Declaration
/// order is the order most models run their blocks, so resident groups come at even intervals
/// of each pass and the copy engine runs ahead while each computes. Kept all at the start (as
/// a plain fill in declaration order would), they leave the link idle once the staging arena
/// is full, for the rest of their compute, on every pass: with a pass bound by the link, a
/// loss of (their compute − staging / link rate) per pass (daemon/DESIGN.md, "Resident
/// groups").
fn resident_groups(groups: &[GroupPlacement], room: u64) -> Vec<bool> {
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
    let total: i128 = groups.iter().map(|g| i128::from(g.nbytes)).sum();
    // Credit in units of 1 / total bytes: a group of n bytes earns n × room and costs n × total
    // when kept (the credit may go below zero: the next groups then wait their turn). Real
    // sizes are far below i128's range; saturating keeps any input from overflowing.
    let mut credit: i128 = 0;
    for (i, g) in groups.iter().enumerate() {
        let n = i128::from(g.nbytes);
        credit = credit.saturating_add(n.saturating_mul(i128::from(room)));
        let cost = n.saturating_mul(total);
        if credit.saturating_mul(2) >= cost && take(i, &mut left) {
            credit = credit.saturating_sub(cost);
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
        let s = split_budget(&groups, 16 * 1024, 0, 256).unwrap();
        assert_eq!(s.staging_bytes, 4096);
        assert_eq!(s.resident, [true; 8]);
        assert_eq!(s.resident_bytes, 8192);
        let s = split_budget(&groups, 6 * 1024, 0, 256).unwrap();
        assert_eq!(s.staging_bytes, 3072);
        assert_eq!(resident_indices(&s), [1, 3, 6]);
        let s = split_budget(&groups, 1024, 0, 256).unwrap();
        assert_eq!((s.staging_bytes, s.resident_bytes), (1024, 0));
    }

    fn resident_indices(s: &BudgetSplit) -> Vec<usize> {
        (s.resident.iter().enumerate())
            .filter_map(|(i, r)| r.then_some(i))
            .collect()
    }

    #[test]
    fn resident_groups_come_at_even_intervals_of_the_pass() {
        let groups: Vec<_> = (0..12).map(|i| group(&format!("g{i}"), 1024)).collect();
        // Staging of three groups, three more resident: one in every four.
        let s = split_budget(&groups, 6 * 1024, 3 * 1024, 256).unwrap();
        assert_eq!(resident_indices(&s), [1, 5, 9]);
        assert_eq!(s.resident_bytes, 3 * 1024);
        // Half of them: every other one.
        let s = split_budget(&groups, 9 * 1024, 3 * 1024, 256).unwrap();
        assert_eq!(resident_indices(&s), [0, 2, 4, 6, 8, 10]);
        // Room for all: all.
        let s = split_budget(&groups, 16 * 1024, 0, 256).unwrap();
        assert_eq!(s.resident, [true; 12]);
        // Two sizes (FLUX's double and single blocks): the room is spread by bytes, and what
        // the spread leaves is filled in order.
        let mut mixed: Vec<_> = (0..4).map(|i| group(&format!("d{i}"), 2048)).collect();
        mixed.extend((0..8).map(|i| group(&format!("s{i}"), 1024)));
        let s = split_budget(&mixed, 11 * 1024, 6 * 1024, 256).unwrap();
        assert_eq!(resident_indices(&s), [1, 4, 7, 10]);
        assert_eq!(s.resident_bytes, 5 * 1024);
    }

    #[test]
    fn budget_errors_name_the_field_and_limit() {
        let groups = vec![group("small", 256), group("big", 4096)];
        let e = split_budget(&groups, 1000, 0, 256).unwrap_err();
        assert_eq!(
            e.to_string(),
            "vram_budget 1000 is smaller than the largest group 'big' (4096 bytes, aligned)"
        );
        let e = split_budget(&groups, 8192, 1024, 256).unwrap_err();
        assert!(matches!(
            e,
            BudgetError::StagingTooSmall { staging: 1024, .. }
        ));
        let e = split_budget(&groups, 8192, 9000, 256).unwrap_err();
        assert_eq!(
            e,
            BudgetError::StagingOverBudget {
                staging: 9000,
                budget: 8192
            }
        );
        let s = split_budget(&groups, 8192, 4096, 256).unwrap();
        assert_eq!(s.resident, [true, false]);
    }
}
