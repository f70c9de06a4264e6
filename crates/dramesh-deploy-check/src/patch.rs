//! The JSON Patch (RFC 6902) operations kustomize accepts in `patches`: `add`, `replace` and
//! `remove`, addressed by JSON Pointers (RFC 6901).
//!
//! Application is all-or-nothing per operation and never guesses: `replace` and `remove`
//! require the target to exist, `add` requires the parent to exist, and an array index must
//! be in range (`-` appends). Other operations (`move`, `copy`, `test`) are refused.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One patch operation as written in a kustomization.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Operation {
    pub op: String,
    pub path: String,
    #[serde(default)]
    pub value: Option<Value>,
}

/// Splits a JSON Pointer into unescaped reference tokens; `""` is the whole document.
pub fn parse_pointer(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let rest = pointer
        .strip_prefix('/')
        .ok_or_else(|| format!("path {pointer:?} must start with '/'"))?;
    Ok(rest
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect())
}

fn index(token: &str, len: usize, allow_end: bool, pointer: &str) -> Result<usize, String> {
    let bad = || format!("path {pointer:?}: {token:?} is not a valid index for an array of {len}");
    // RFC 6901: no leading zeros, no signs.
    if token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
        return Err(bad());
    }
    let i: usize = token.parse().map_err(|_| bad())?;
    if i < len || (allow_end && i == len) {
        Ok(i)
    } else {
        Err(bad())
    }
}

fn walk<'a>(doc: &'a mut Value, tokens: &[String], pointer: &str) -> Result<&'a mut Value, String> {
    let mut cur = doc;
    for t in tokens {
        cur = match cur {
            Value::Object(map) => map
                .get_mut(t)
                .ok_or_else(|| format!("path {pointer:?}: no member {t:?}"))?,
            Value::Array(items) => {
                let i = index(t, items.len(), false, pointer)?;
                &mut items[i]
            }
            _ => return Err(format!("path {pointer:?}: {t:?} goes through a scalar")),
        };
    }
    Ok(cur)
}

/// Applies one operation to `doc`.
pub fn apply(doc: &mut Value, op: &Operation) -> Result<(), String> {
    let tokens = parse_pointer(&op.path)?;
    let pointer = op.path.as_str();
    let value = || {
        op.value
            .clone()
            .ok_or_else(|| format!("{} {pointer:?} needs a value", op.op))
    };
    let Some((last, parent_tokens)) = tokens.split_last() else {
        return match op.op.as_str() {
            "add" | "replace" => {
                *doc = value()?;
                Ok(())
            }
            "remove" => Err("cannot remove the whole document".to_string()),
            other => Err(format!("unsupported patch operation {other:?}")),
        };
    };
    let parent = walk(doc, parent_tokens, pointer)?;
    match (op.op.as_str(), parent) {
        ("add", Value::Object(map)) => {
            map.insert(last.clone(), value()?);
        }
        ("add", Value::Array(items)) => {
            let v = value()?;
            if last == "-" {
                items.push(v);
            } else {
                let i = index(last, items.len(), true, pointer)?;
                items.insert(i, v);
            }
        }
        ("replace", Value::Object(map)) => {
            let slot = map
                .get_mut(last)
                .ok_or_else(|| format!("replace {pointer:?}: no member {last:?}"))?;
            *slot = value()?;
        }
        ("replace", Value::Array(items)) => {
            let i = index(last, items.len(), false, pointer)?;
            items[i] = value()?;
        }
        ("remove", Value::Object(map)) => {
            map.remove(last)
                .ok_or_else(|| format!("remove {pointer:?}: no member {last:?}"))?;
        }
        ("remove", Value::Array(items)) => {
            let i = index(last, items.len(), false, pointer)?;
            items.remove(i);
        }
        ("add" | "replace" | "remove", _) => {
            return Err(format!(
                "path {pointer:?}: parent is not an object or array"
            ));
        }
        (other, _) => {
            return Err(format!(
                "unsupported patch operation {other:?} (supported: add, replace, remove)"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn op(op: &str, path: &str, value: Option<Value>) -> Operation {
        Operation {
            op: op.into(),
            path: path.into(),
            value,
        }
    }

    #[test]
    fn pointer_unescapes_tokens() {
        assert_eq!(
            parse_pointer("/metadata/labels/a~1b~0c").unwrap(),
            vec!["metadata", "labels", "a/b~c"]
        );
        assert!(parse_pointer("metadata").is_err());
        assert!(parse_pointer("").unwrap().is_empty());
    }

    #[test]
    fn add_appends_inserts_and_sets() {
        let mut d = json!({"a": [1, 2], "m": {}});
        apply(&mut d, &op("add", "/a/-", Some(json!(3)))).unwrap();
        apply(&mut d, &op("add", "/a/0", Some(json!(0)))).unwrap();
        apply(&mut d, &op("add", "/m/k", Some(json!("v")))).unwrap();
        assert_eq!(d, json!({"a": [0, 1, 2, 3], "m": {"k": "v"}}));
    }

    #[test]
    fn replace_and_remove_require_the_target() {
        let mut d = json!({"a": [1, 2], "m": {"k": 1}});
        apply(&mut d, &op("replace", "/a/1", Some(json!(9)))).unwrap();
        apply(&mut d, &op("remove", "/m/k", None)).unwrap();
        assert_eq!(d, json!({"a": [1, 9], "m": {}}));
        let before = d.clone();
        assert!(apply(&mut d, &op("replace", "/m/missing", Some(json!(1)))).is_err());
        assert!(apply(&mut d, &op("remove", "/a/2", None)).is_err());
        assert!(apply(&mut d, &op("add", "/a/3", Some(json!(1)))).is_err());
        assert!(apply(&mut d, &op("add", "/a/01", Some(json!(1)))).is_err());
        assert!(apply(&mut d, &op("add", "/nope/x", Some(json!(1)))).is_err());
        assert!(apply(&mut d, &op("add", "/a/-", None)).is_err());
        assert!(apply(&mut d, &op("move", "/a/0", None)).is_err());
        assert_eq!(d, before, "failed operations leave the document unchanged");
    }
}
