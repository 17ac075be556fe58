//! `GET /admin/teams` and `GET /admin/teams/{team}` through a gateway:
//! teams, limits and keys are the same on every node (they live in etcd),
//! but each node counts only the sandboxes it holds, so the gateway asks
//! every node and sums each team's use.

use serde::{Deserialize, Serialize};

use crate::wire::Team;

/// One node's answer: a team (`GET /admin/teams/{team}`) or all of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TeamUse {
    All(Vec<Team>),
    One(Team),
}

/// Whether `path` is one the gateway answers with every node's use summed.
pub fn is_team_use(path: &str) -> bool {
    match path.strip_prefix("/admin/teams") {
        Some("") => true,
        Some(rest) => rest
            .strip_prefix('/')
            .is_some_and(|team| !team.is_empty() && !team.contains('/')),
        None => false,
    }
}

/// Adds `other`'s use (one node's answer: a team or a list of teams) to
/// `total`'s, team by team (`teamID`); a team `total` lacks is left out (a
/// node that heard of it a moment later).
pub fn add_use(total: &mut TeamUse, other: &TeamUse) {
    match (total, other) {
        (TeamUse::All(teams), TeamUse::All(others)) => {
            for team in teams {
                if let Some(o) = others.iter().find(|o| o.team_id == team.team_id) {
                    add_team_use(team, o);
                }
            }
        }
        (TeamUse::One(team), TeamUse::One(o)) if o.team_id == team.team_id => add_team_use(team, o),
        _ => {}
    }
}

fn add_team_use(team: &mut Team, other: &Team) {
    team.usage.sandboxes += other.usage.sandboxes;
    team.usage.memory_mb += other.usage.memory_mb;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// `add_use` on answers as JSON.
    fn add_use(total: &mut Value, other: &Value) {
        let mut sum: TeamUse = serde_json::from_value(total.clone()).unwrap();
        super::add_use(&mut sum, &serde_json::from_value(other.clone()).unwrap());
        *total = serde_json::to_value(sum).unwrap();
    }

    #[test]
    fn team_paths_are_told_from_keys_and_others() {
        assert!(is_team_use("/admin/teams"));
        assert!(is_team_use("/admin/teams/t-1"));
        assert!(!is_team_use("/admin/teams/t-1/keys"));
        assert!(!is_team_use("/admin/teams/"));
        assert!(!is_team_use("/admin/keys/k"));
        assert!(!is_team_use("/admin/teamsx"));
    }

    #[test]
    fn each_team_use_is_the_sum_over_nodes() {
        let team = |id: &str, sandboxes: u64, memory: u64| {
            json!({"teamID": id, "name": id, "createdAt": "2026-12-06T00:00:00.000Z",
                   "limits": {"maxSandboxes": 2}, "requestsPerSecond": null,
                   "usage": {"sandboxes": sandboxes, "memoryMB": memory}, "keys": 1})
        };
        let mut total = json!([team("a", 1, 256), team("b", 0, 0)]);
        add_use(
            &mut total,
            &json!([team("b", 2, 512), team("a", 1, 256), team("c", 5, 5)]),
        );
        assert_eq!(total, json!([team("a", 2, 512), team("b", 2, 512)]));

        let mut one = team("a", 1, 256);
        add_use(&mut one, &team("a", 3, 768));
        assert_eq!(one, team("a", 4, 1024));
        // Another team's answer, or another shape, adds nothing.
        add_use(&mut one, &team("b", 3, 768));
        add_use(&mut one, &json!([team("a", 3, 768)]));
        assert_eq!(one, team("a", 4, 1024));
    }
}
