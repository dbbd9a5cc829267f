//! Label selectors in a canonical form: validated like the API server does, matched
//! against labels, and rendered canonically (two selectors that select the same thing by
//! the same requirements render the same, so address-set ids are stable).

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::names::{label_key_problem, label_value_problem};
use crate::model::{FieldError, Labels};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    pub values: BTreeSet<String>,
}

impl Requirement {
    fn matches(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            // A missing key satisfies NotIn, as in Kubernetes.
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

/// A conjunction of requirements; no requirement selects everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Selector {
    requirements: Vec<Requirement>,
}

impl Selector {
    /// Validates and canonicalises `selector`; `field` names it in errors.
    pub fn parse(selector: &LabelSelector, field: &str) -> Result<Self, FieldError> {
        let mut requirements = Vec::new();
        for (key, value) in selector.match_labels.iter().flatten() {
            let f = format!("{field}.matchLabels");
            if let Some(p) = label_key_problem(key).or_else(|| label_value_problem(value)) {
                return Err(FieldError::new(&f, p));
            }
            requirements.push(Requirement {
                key: key.clone(),
                operator: Operator::In,
                values: BTreeSet::from([value.clone()]),
            });
        }
        for (i, expr) in selector.match_expressions.iter().flatten().enumerate() {
            let f = format!("{field}.matchExpressions[{i}]");
            if let Some(p) = label_key_problem(&expr.key) {
                return Err(FieldError::new(&format!("{f}.key"), p));
            }
            let operator = match expr.operator.as_str() {
                "In" => Operator::In,
                "NotIn" => Operator::NotIn,
                "Exists" => Operator::Exists,
                "DoesNotExist" => Operator::DoesNotExist,
                other => {
                    return Err(FieldError::new(
                        &format!("{f}.operator"),
                        format!("unsupported value {other:?}: supported values \"In\", \"NotIn\", \"Exists\", \"DoesNotExist\""),
                    ))
                }
            };
            let values: BTreeSet<String> = expr.values.iter().flatten().cloned().collect();
            let needs_values = matches!(operator, Operator::In | Operator::NotIn);
            if needs_values && values.is_empty() {
                return Err(FieldError::new(
                    &format!("{f}.values"),
                    "must be specified when `operator` is 'In' or 'NotIn'",
                ));
            }
            if !needs_values && !values.is_empty() {
                return Err(FieldError::new(
                    &format!("{f}.values"),
                    "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                ));
            }
            if let Some(p) = values.iter().find_map(|v| label_value_problem(v)) {
                return Err(FieldError::new(&format!("{f}.values"), p));
            }
            requirements.push(Requirement {
                key: expr.key.clone(),
                operator,
                values,
            });
        }
        requirements.sort();
        requirements.dedup();
        Ok(Selector { requirements })
    }

    pub fn is_everything(&self) -> bool {
        self.requirements.is_empty()
    }

    pub fn matches(&self, labels: &Labels) -> bool {
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// A requirement `key in (values)` that every match satisfies, to narrow candidates
    /// through a label index: the one with the fewest values.
    pub fn index_hint(&self) -> Option<(&str, &BTreeSet<String>)> {
        self.requirements
            .iter()
            .filter(|r| r.operator == Operator::In)
            .min_by_key(|r| r.values.len())
            .map(|r| (r.key.as_str(), &r.values))
    }
}

/// Canonical text: `{}` for everything, else `{k in (a,b), k notin (c), k, !k}`.
impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, r) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            let values = || r.values.iter().cloned().collect::<Vec<_>>().join(",");
            match r.operator {
                Operator::In => write!(f, "{} in ({})", r.key, values())?,
                Operator::NotIn => write!(f, "{} notin ({})", r.key, values())?,
                Operator::Exists => write!(f, "{}", r.key)?,
                Operator::DoesNotExist => write!(f, "!{}", r.key)?,
            }
        }
        f.write_str("}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn expr(key: &str, op: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: (!values.is_empty()).then(|| values.iter().map(|v| v.to_string()).collect()),
        }
    }

    fn selector(exprs: Vec<LabelSelectorRequirement>) -> Result<Selector, FieldError> {
        Selector::parse(
            &LabelSelector {
                match_expressions: Some(exprs),
                match_labels: None,
            },
            "spec.podSelector",
        )
    }

    #[test]
    fn operators_match_as_kubernetes_does() {
        let a = labels(&[("pod", "a")]);
        let none = labels(&[]);
        let cases: &[(&str, &[&str], bool, bool)] = &[
            // operator, values, matches {pod=a}, matches {}
            ("In", &["a", "b"], true, false),
            ("In", &["b"], false, false),
            ("NotIn", &["a"], false, true),
            ("NotIn", &["b"], true, true),
            ("Exists", &[], true, false),
            ("DoesNotExist", &[], false, true),
        ];
        for (op, values, on_a, on_none) in cases {
            let s = selector(vec![expr("pod", op, values)]).unwrap();
            assert_eq!(s.matches(&a), *on_a, "{op} {values:?} on pod=a");
            assert_eq!(s.matches(&none), *on_none, "{op} {values:?} on no labels");
        }
    }

    #[test]
    fn empty_selector_matches_everything() {
        let s = Selector::parse(&LabelSelector::default(), "f").unwrap();
        assert!(s.is_everything());
        assert!(s.matches(&labels(&[("x", "y")])));
        assert_eq!(s.to_string(), "{}");
    }

    #[test]
    fn match_labels_and_expressions_are_anded_and_canonical() {
        let s = Selector::parse(
            &LabelSelector {
                match_labels: Some([("pod".to_string(), "a".to_string())].into()),
                match_expressions: Some(vec![expr("tier", "NotIn", &["db", "cache"])]),
            },
            "f",
        )
        .unwrap();
        assert!(s.matches(&labels(&[("pod", "a"), ("tier", "web")])));
        assert!(!s.matches(&labels(&[("pod", "a"), ("tier", "db")])));
        assert!(!s.matches(&labels(&[("pod", "b")])));
        assert_eq!(s.to_string(), "{pod in (a), tier notin (cache,db)}");
        let same = selector(vec![
            expr("tier", "NotIn", &["cache", "db"]),
            expr("pod", "In", &["a"]),
        ])
        .unwrap();
        assert_eq!(s, same);
    }

    #[test]
    fn invalid_selectors_name_the_field() {
        let cases = [
            (
                expr("pod", "Equals", &["a"]),
                "spec.podSelector.matchExpressions[0].operator",
            ),
            (
                expr("pod", "In", &[]),
                "spec.podSelector.matchExpressions[0].values",
            ),
            (
                expr("pod", "Exists", &["a"]),
                "spec.podSelector.matchExpressions[0].values",
            ),
            (
                expr("-bad", "Exists", &[]),
                "spec.podSelector.matchExpressions[0].key",
            ),
            (
                expr("pod", "In", &["bad value"]),
                "spec.podSelector.matchExpressions[0].values",
            ),
        ];
        for (e, field) in cases {
            let err = selector(vec![e.clone()]).unwrap_err();
            assert_eq!(err.field, field, "{e:?}: {}", err.reason);
        }
    }
}
