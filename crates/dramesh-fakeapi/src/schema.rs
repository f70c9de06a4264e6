//! Structural-schema validation of custom resources, as the API server runs it on every write to
//! a CRD kind: the CRD's `openAPIV3Schema` for the served version, compiled once, then applied to
//! each object after the write (create, update, merge-patched result, status result).
//!
//! Checked: `type` (with `x-kubernetes-int-or-string` and `anyOf` branches), `required`, `enum`,
//! `format` (`date-time` as the API server's format registry checks it; `int32`/`int64` ranges,
//! which the API server does not check but Karmada's typed clients would fail to decode),
//! `minimum`/`maximum` (and the exclusive forms), `minLength`/`maxLength` (bytes, as Go counts),
//! `minItems`/`maxItems`, `pattern`, `nullable`, `x-kubernetes-preserve-unknown-fields`,
//! `x-kubernetes-list-type` `set`/`map` (duplicates, map keys required). As the API server does,
//! nulls in non-nullable fields are pruned and `default`s are filled in before validation.
//!
//! Deliberately stricter than the API server: a field the schema does not know is an error naming
//! its path (the API server prunes it silently; tests want to know dramesh wrote a field Karmada
//! would drop). Keywords that would change the verdict but are not implemented (`oneOf`, `allOf`,
//! `not`, `x-kubernetes-validations`, ...) make compilation fail, so nothing is under-validated
//! silently. The root `metadata` is the API server's ObjectMeta, not validated here.

use std::collections::BTreeMap;

use regex::Regex;
use serde_json::{Map, Value};

/// One failed check, as a `StatusCause` of a 422 Invalid answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    /// `FieldValueRequired`, `FieldValueInvalid`, `FieldValueTypeInvalid`,
    /// `FieldValueNotSupported`, `FieldValueTooLong`, `FieldValueTooMany`, `FieldValueDuplicate`,
    /// `FieldValueForbidden` (an unknown field).
    pub reason: &'static str,
    /// Human-readable, as the API server words it (without the field path).
    pub message: String,
    /// The field path, `spec.clusters[0].name` or `spec.resourceRequest[cpu]`.
    pub field: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Type {
    Object,
    Array,
    String,
    Integer,
    Number,
    Boolean,
}

/// A compiled schema node.
#[derive(Debug, Default)]
pub struct Schema {
    ty: Option<Type>,
    properties: BTreeMap<String, Schema>,
    additional: Option<Box<Schema>>,
    items: Option<Box<Schema>>,
    required: Vec<String>,
    enumeration: Option<Vec<Value>>,
    format: Option<String>,
    minimum: Option<f64>,
    maximum: Option<f64>,
    exclusive_minimum: bool,
    exclusive_maximum: bool,
    min_length: Option<u64>,
    max_length: Option<u64>,
    min_items: Option<u64>,
    max_items: Option<u64>,
    pattern: Option<Regex>,
    nullable: bool,
    preserve_unknown: bool,
    int_or_string: bool,
    any_of: Vec<Schema>,
    default: Option<Value>,
    list_type: Option<String>,
    list_map_keys: Vec<String>,
}

/// Keywords with no effect on the verdict.
const IGNORED: &[&str] = &[
    "description",
    "title",
    "example",
    "externalDocs",
    "x-kubernetes-map-type",
];

impl Schema {
    /// Compiles an `openAPIV3Schema`; `at` names it in errors.
    pub fn compile(v: &Value, at: &str) -> Result<Schema, String> {
        let Some(m) = v.as_object() else {
            return Err(format!("{at}: a schema must be an object"));
        };
        let mut s = Schema::default();
        for (k, x) in m {
            let bad = || format!("{at}.{k}: unexpected value {x}");
            match k.as_str() {
                "type" => {
                    s.ty = Some(match x.as_str() {
                        Some("object") => Type::Object,
                        Some("array") => Type::Array,
                        Some("string") => Type::String,
                        Some("integer") => Type::Integer,
                        Some("number") => Type::Number,
                        Some("boolean") => Type::Boolean,
                        _ => return Err(bad()),
                    })
                }
                "properties" => {
                    for (p, ps) in x.as_object().ok_or_else(bad)? {
                        s.properties
                            .insert(p.clone(), Schema::compile(ps, &format!("{at}.{p}"))?);
                    }
                }
                "additionalProperties" => match x {
                    Value::Bool(true) => s.preserve_unknown = true,
                    Value::Bool(false) => {}
                    _ => {
                        s.additional = Some(Box::new(Schema::compile(x, &format!("{at}[*]"))?));
                    }
                },
                "items" => s.items = Some(Box::new(Schema::compile(x, &format!("{at}[*]"))?)),
                "required" => {
                    for r in x.as_array().ok_or_else(bad)? {
                        s.required.push(r.as_str().ok_or_else(bad)?.to_string());
                    }
                }
                "enum" => s.enumeration = Some(x.as_array().ok_or_else(bad)?.clone()),
                "format" => s.format = Some(x.as_str().ok_or_else(bad)?.to_string()),
                "minimum" => s.minimum = Some(x.as_f64().ok_or_else(bad)?),
                "maximum" => s.maximum = Some(x.as_f64().ok_or_else(bad)?),
                "exclusiveMinimum" => s.exclusive_minimum = x.as_bool().ok_or_else(bad)?,
                "exclusiveMaximum" => s.exclusive_maximum = x.as_bool().ok_or_else(bad)?,
                "minLength" => s.min_length = Some(x.as_u64().ok_or_else(bad)?),
                "maxLength" => s.max_length = Some(x.as_u64().ok_or_else(bad)?),
                "minItems" => s.min_items = Some(x.as_u64().ok_or_else(bad)?),
                "maxItems" => s.max_items = Some(x.as_u64().ok_or_else(bad)?),
                "pattern" => {
                    let p = x.as_str().ok_or_else(bad)?;
                    s.pattern =
                        Some(Regex::new(p).map_err(|e| format!("{at}.pattern: {p:?}: {e}"))?);
                }
                "nullable" => s.nullable = x.as_bool().ok_or_else(bad)?,
                "x-kubernetes-preserve-unknown-fields" => {
                    s.preserve_unknown = x.as_bool().ok_or_else(bad)?
                }
                "x-kubernetes-int-or-string" => s.int_or_string = x.as_bool().ok_or_else(bad)?,
                "anyOf" => {
                    for (i, b) in x.as_array().ok_or_else(bad)?.iter().enumerate() {
                        s.any_of
                            .push(Schema::compile(b, &format!("{at}.anyOf[{i}]"))?);
                    }
                }
                "default" => s.default = Some(x.clone()),
                "x-kubernetes-list-type" => {
                    let t = x.as_str().ok_or_else(bad)?;
                    if !matches!(t, "atomic" | "set" | "map") {
                        return Err(bad());
                    }
                    s.list_type = Some(t.to_string());
                }
                "x-kubernetes-list-map-keys" => {
                    for r in x.as_array().ok_or_else(bad)? {
                        s.list_map_keys
                            .push(r.as_str().ok_or_else(bad)?.to_string());
                    }
                }
                k if IGNORED.contains(&k) => {}
                other => {
                    return Err(format!(
                        "{at}: schema keyword {other:?} is not implemented by the fake's validator"
                    ));
                }
            }
        }
        Ok(s)
    }

    /// Prunes nulls of non-nullable fields, fills defaults, and validates `obj` as a whole
    /// object of this kind (the root `metadata` is left to the API server's ObjectMeta rules).
    pub fn validate_root(&self, obj: &mut Value) -> Vec<Cause> {
        let mut causes = Vec::new();
        let Some(m) = obj.as_object_mut() else {
            causes.push(Cause {
                reason: "FieldValueTypeInvalid",
                message: "Invalid value: the object must be a JSON object".into(),
                field: "<root>".into(),
            });
            return causes;
        };
        if !m.get("metadata").is_none_or(Value::is_object) {
            causes.push(Cause {
                reason: "FieldValueTypeInvalid",
                message: "Invalid value: must be of type object".into(),
                field: "metadata".into(),
            });
        }
        self.object_fields(m, "", &mut causes, &["metadata"]);
        causes
    }

    /// Validates one value at `path` (which is never empty below the root).
    fn check(&self, v: &mut Value, path: &str, causes: &mut Vec<Cause>) {
        let cause = |reason, message: String| Cause {
            reason,
            message,
            field: path.to_string(),
        };
        if v.is_null() {
            // Non-nullable nulls are pruned by the parent before we get here.
            return;
        }
        if !self.any_of.is_empty() {
            let ok = self.any_of.iter().any(|b| {
                let mut probe = v.clone();
                let mut c = Vec::new();
                b.check(&mut probe, path, &mut c);
                c.is_empty()
            });
            if !ok {
                causes.push(cause(
                    "FieldValueInvalid",
                    format!("Invalid value: {}: must match a schema in anyOf", short(v)),
                ));
                return;
            }
        }
        let type_ok = match (self.ty, &*v) {
            _ if self.int_or_string => v.is_string() || is_integer(v),
            (None, _) => true,
            (Some(Type::Object), Value::Object(_)) => true,
            (Some(Type::Array), Value::Array(_)) => true,
            (Some(Type::String), Value::String(_)) => true,
            (Some(Type::Integer), x) => is_integer(x),
            (Some(Type::Number), Value::Number(_)) => true,
            (Some(Type::Boolean), Value::Bool(_)) => true,
            _ => false,
        };
        if !type_ok {
            let want = if self.int_or_string {
                "integer or string".to_string()
            } else {
                format!("{:?}", self.ty.unwrap_or(Type::Object)).to_lowercase()
            };
            causes.push(cause(
                "FieldValueTypeInvalid",
                format!(
                    "Invalid value: {}: {path} in body must be of type {want}: {:?}",
                    short(v),
                    json_type(v)
                ),
            ));
            return;
        }
        if let Some(e) = &self.enumeration
            && !e.contains(v)
        {
            let supported: Vec<String> = e.iter().map(Value::to_string).collect();
            causes.push(cause(
                "FieldValueNotSupported",
                format!(
                    "Unsupported value: {}: supported values: {}",
                    short(v),
                    supported.join(", ")
                ),
            ));
        }
        match v {
            Value::String(s) => self.check_string(s, path, causes),
            Value::Number(_) => self.check_number(v, path, causes),
            Value::Array(items) => self.check_array(items, path, causes),
            Value::Object(m) if self.ty == Some(Type::Object) || !self.properties.is_empty() => {
                self.object_fields(m, path, causes, &[]);
            }
            _ => {}
        }
    }

    fn check_string(&self, s: &str, path: &str, causes: &mut Vec<Cause>) {
        let mut push = |reason, message: String| {
            causes.push(Cause {
                reason,
                message,
                field: path.to_string(),
            })
        };
        let len = s.len() as u64;
        if let Some(max) = self.max_length
            && len > max
        {
            push(
                "FieldValueTooLong",
                format!("Too long: may not be more than {max} bytes"),
            );
        }
        if let Some(min) = self.min_length
            && len < min
        {
            push(
                "FieldValueInvalid",
                format!(
                    "Invalid value: {:?}: {path} in body should be at least {min} chars long",
                    s
                ),
            );
        }
        if let Some(p) = &self.pattern
            && !p.is_match(s)
        {
            push(
                "FieldValueInvalid",
                format!(
                    "Invalid value: {s:?}: {path} in body should match '{}'",
                    p.as_str()
                ),
            );
        }
        if self.format.as_deref() == Some("date-time")
            && s.parse::<k8s_openapi::jiff::Timestamp>().is_err()
        {
            push(
                "FieldValueInvalid",
                format!("Invalid value: {s:?}: {path} in body must be of type date-time: {s:?}"),
            );
        }
    }

    fn check_number(&self, v: &Value, path: &str, causes: &mut Vec<Cause>) {
        let mut push = |message: String| {
            causes.push(Cause {
                reason: "FieldValueInvalid",
                message,
                field: path.to_string(),
            })
        };
        let range = match self.format.as_deref() {
            Some("int32") => Some((i64::from(i32::MIN), i64::from(i32::MAX))),
            Some("int64") => Some((i64::MIN, i64::MAX)),
            _ => None,
        };
        if let Some((lo, hi)) = range
            && !v.as_i64().is_some_and(|i| (lo..=hi).contains(&i))
        {
            push(format!(
                "Invalid value: {v}: {path} in body must be of type {}",
                self.format.as_deref().unwrap_or_default()
            ));
        }
        let Some(x) = v.as_f64() else { return };
        if let Some(min) = self.minimum
            && (x < min || (self.exclusive_minimum && x == min))
        {
            let what = if self.exclusive_minimum {
                "greater than"
            } else {
                "greater than or equal to"
            };
            push(format!(
                "Invalid value: {v}: {path} in body should be {what} {min}"
            ));
        }
        if let Some(max) = self.maximum
            && (x > max || (self.exclusive_maximum && x == max))
        {
            let what = if self.exclusive_maximum {
                "less than"
            } else {
                "less than or equal to"
            };
            push(format!(
                "Invalid value: {v}: {path} in body should be {what} {max}"
            ));
        }
    }

    fn check_array(&self, items: &mut [Value], path: &str, causes: &mut Vec<Cause>) {
        let n = items.len() as u64;
        if let Some(max) = self.max_items
            && n > max
        {
            causes.push(Cause {
                reason: "FieldValueTooMany",
                message: format!("Too many: {n}: must have at most {max} items"),
                field: path.to_string(),
            });
        }
        if let Some(min) = self.min_items
            && n < min
        {
            causes.push(Cause {
                reason: "FieldValueInvalid",
                message: format!(
                    "Invalid value: {n}: {path} in body should have at least {min} items"
                ),
                field: path.to_string(),
            });
        }
        if let Some(item) = &self.items {
            for (i, x) in items.iter_mut().enumerate() {
                let at = format!("{path}[{i}]");
                if x.is_null() && !item.nullable {
                    causes.push(Cause {
                        reason: "FieldValueTypeInvalid",
                        message: "Invalid value: \"null\": must not be null".into(),
                        field: at,
                    });
                    continue;
                }
                item.check(x, &at, causes);
            }
        }
        match self.list_type.as_deref() {
            Some("set") => {
                for i in 0..items.len() {
                    if items[..i].contains(&items[i]) {
                        causes.push(Cause {
                            reason: "FieldValueDuplicate",
                            message: format!("Duplicate value: {}", short(&items[i])),
                            field: format!("{path}[{i}]"),
                        });
                    }
                }
            }
            Some("map") => {
                let mut seen: Vec<Vec<Value>> = Vec::new();
                for (i, x) in items.iter().enumerate() {
                    let key: Vec<Value> = self
                        .list_map_keys
                        .iter()
                        .map(|k| x.get(k).cloned().unwrap_or(Value::Null))
                        .collect();
                    if seen.contains(&key) {
                        causes.push(Cause {
                            reason: "FieldValueDuplicate",
                            message: format!("Duplicate value: {}", Value::from(key.clone())),
                            field: format!("{path}[{i}]"),
                        });
                    }
                    seen.push(key);
                }
            }
            _ => {}
        }
    }

    /// Fields of an object: prune nulls, fill defaults, required, known fields, recursion.
    fn object_fields(
        &self,
        m: &mut Map<String, Value>,
        path: &str,
        causes: &mut Vec<Cause>,
        skip: &[&str],
    ) {
        let join = |k: &str| {
            if path.is_empty() {
                k.to_string()
            } else {
                format!("{path}.{k}")
            }
        };
        // Nulls where the schema does not allow them are pruned (apiextensions-apiserver).
        m.retain(|k, x| {
            !x.is_null()
                || match self.properties.get(k) {
                    Some(p) => p.nullable,
                    None => self.additional.as_ref().is_some_and(|a| a.nullable),
                }
        });
        for (k, p) in &self.properties {
            if let Some(d) = &p.default
                && !m.contains_key(k)
            {
                m.insert(k.clone(), d.clone());
            }
        }
        for r in &self.required {
            if !m.contains_key(r) {
                causes.push(Cause {
                    reason: "FieldValueRequired",
                    message: "Required value".into(),
                    field: join(r),
                });
            }
        }
        for (k, x) in m.iter_mut() {
            if skip.contains(&k.as_str()) {
                continue;
            }
            if let Some(p) = self.properties.get(k) {
                p.check(x, &join(k), causes);
            } else if let Some(a) = &self.additional {
                let at = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}[{k}]")
                };
                a.check(x, &at, causes);
            } else if !self.preserve_unknown {
                causes.push(Cause {
                    reason: "FieldValueForbidden",
                    message: format!(
                        "Forbidden: unknown field {k:?} (the API server would prune it silently)"
                    ),
                    field: join(k),
                });
            }
        }
    }
}

fn is_integer(v: &Value) -> bool {
    v.is_i64()
        || v.is_u64()
        || v.as_f64()
            .is_some_and(|f| f.fract() == 0.0 && f.is_finite())
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A value for a message, cut short.
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() <= 80 {
        return s;
    }
    let mut end = 77;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// The served version's schema of a CRD manifest (YAML as `kubectl apply` reads it), with the
/// kind it is for.
pub struct Crd {
    /// `spec.names.kind`.
    pub kind: String,
    /// `spec.group`.
    pub group: String,
    /// The compiled `openAPIV3Schema` of the version asked for.
    pub schema: Schema,
}

/// Loads `file` (a CRD manifest) and compiles the schema of `version`.
pub fn load_crd(file: &std::path::Path, version: &str) -> Result<Crd, String> {
    let at = file.display();
    let text = std::fs::read_to_string(file).map_err(|e| format!("{at}: {e}"))?;
    let doc: Value = serde_norway::from_str(&text).map_err(|e| format!("{at}: {e}"))?;
    let kind = doc["spec"]["names"]["kind"]
        .as_str()
        .ok_or_else(|| format!("{at}: spec.names.kind is missing"))?;
    let group = doc["spec"]["group"]
        .as_str()
        .ok_or_else(|| format!("{at}: spec.group is missing"))?;
    let versions = doc["spec"]["versions"]
        .as_array()
        .ok_or_else(|| format!("{at}: spec.versions is missing"))?;
    let v = versions
        .iter()
        .find(|v| v["name"] == version && v["served"] == true)
        .ok_or_else(|| format!("{at}: no served version {version}"))?;
    let schema = Schema::compile(
        &v["schema"]["openAPIV3Schema"],
        &format!("{at}: {version} openAPIV3Schema"),
    )?;
    Ok(Crd {
        kind: kind.to_string(),
        group: group.to_string(),
        schema,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn compile(v: Value) -> Schema {
        Schema::compile(&v, "test").unwrap()
    }

    /// Validates `obj` under `{spec: schema}` and returns the causes' (field, reason).
    fn run(schema: Value, spec: Value) -> Vec<(String, &'static str)> {
        let s = compile(json!({"type": "object", "properties": {"spec": schema}}));
        let mut obj = json!({"spec": spec});
        s.validate_root(&mut obj)
            .into_iter()
            .map(|c| (c.field, c.reason))
            .collect()
    }

    fn ok(schema: Value, spec: Value) {
        let c = run(schema.clone(), spec.clone());
        assert!(c.is_empty(), "{spec} under {schema}: {c:?}");
    }

    fn bad(schema: Value, spec: Value, field: &str, reason: &str) {
        let c = run(schema.clone(), spec.clone());
        assert!(
            c.iter().any(|(f, r)| f == field && *r == reason),
            "{spec} under {schema}: expected {field} {reason}, got {c:?}"
        );
    }

    #[test]
    fn types() {
        let s = json!({"type": "object", "properties": {
            "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"},
            "b": {"type": "boolean"}, "a": {"type": "array", "items": {"type": "string"}},
            "o": {"type": "object", "properties": {"x": {"type": "string"}}}}});
        ok(
            s.clone(),
            json!({"s": "x", "i": 3, "n": 1.5, "b": true, "a": ["y"], "o": {"x": "z"}}),
        );
        bad(
            s.clone(),
            json!({"s": 1}),
            "spec.s",
            "FieldValueTypeInvalid",
        );
        bad(
            s.clone(),
            json!({"i": 1.5}),
            "spec.i",
            "FieldValueTypeInvalid",
        );
        bad(
            s.clone(),
            json!({"i": "1"}),
            "spec.i",
            "FieldValueTypeInvalid",
        );
        bad(
            s.clone(),
            json!({"n": "1"}),
            "spec.n",
            "FieldValueTypeInvalid",
        );
        bad(
            s.clone(),
            json!({"b": "true"}),
            "spec.b",
            "FieldValueTypeInvalid",
        );
        bad(
            s.clone(),
            json!({"a": "y"}),
            "spec.a",
            "FieldValueTypeInvalid",
        );
        bad(
            s.clone(),
            json!({"a": [1]}),
            "spec.a[0]",
            "FieldValueTypeInvalid",
        );
        bad(s, json!({"o": []}), "spec.o", "FieldValueTypeInvalid");
    }

    #[test]
    fn required_and_unknown_fields() {
        let s = json!({"type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}}});
        ok(s.clone(), json!({"name": "a"}));
        bad(s.clone(), json!({}), "spec.name", "FieldValueRequired");
        bad(
            s,
            json!({"name": "a", "nmae": "b"}),
            "spec.nmae",
            "FieldValueForbidden",
        );
    }

    #[test]
    fn enum_and_strings() {
        let s = json!({"type": "object", "properties": {
            "e": {"type": "string", "enum": ["True", "False"]},
            "l": {"type": "string", "maxLength": 3, "minLength": 1},
            "p": {"type": "string", "pattern": "^[A-Z][a-z]*$"},
            "t": {"type": "string", "format": "date-time"}}});
        ok(
            s.clone(),
            json!({"e": "True", "l": "abc", "p": "Ab", "t": "2026-11-25T12:00:00Z"}),
        );
        bad(
            s.clone(),
            json!({"e": "true"}),
            "spec.e",
            "FieldValueNotSupported",
        );
        bad(
            s.clone(),
            json!({"l": "abcd"}),
            "spec.l",
            "FieldValueTooLong",
        );
        bad(s.clone(), json!({"l": ""}), "spec.l", "FieldValueInvalid");
        bad(s.clone(), json!({"p": "ab"}), "spec.p", "FieldValueInvalid");
        bad(s, json!({"t": "yesterday"}), "spec.t", "FieldValueInvalid");
    }

    #[test]
    fn numbers() {
        let s = json!({"type": "object", "properties": {
            "r": {"type": "integer", "format": "int32", "minimum": 0, "maximum": 10},
            "x": {"type": "integer", "minimum": 1, "exclusiveMinimum": true}}});
        ok(s.clone(), json!({"r": 0, "x": 2}));
        bad(s.clone(), json!({"r": -1}), "spec.r", "FieldValueInvalid");
        bad(s.clone(), json!({"r": 11}), "spec.r", "FieldValueInvalid");
        bad(s.clone(), json!({"x": 1}), "spec.x", "FieldValueInvalid");
        let big = json!({"type": "object", "properties": {
            "r": {"type": "integer", "format": "int32"}}});
        bad(
            big,
            json!({"r": 3_000_000_000u64}),
            "spec.r",
            "FieldValueInvalid",
        );
    }

    #[test]
    fn arrays_and_list_types() {
        let s = json!({"type": "object", "properties": {
            "m": {"type": "array", "maxItems": 2, "items": {"type": "string"}},
            "set": {"type": "array", "x-kubernetes-list-type": "set", "items": {"type": "string"}},
            "map": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
                "items": {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": "integer"}}}}}});
        ok(
            s.clone(),
            json!({"m": ["a", "b"], "set": ["a", "b"], "map": [{"name": "a"}, {"name": "b", "v": 1}]}),
        );
        bad(
            s.clone(),
            json!({"m": ["a", "b", "c"]}),
            "spec.m",
            "FieldValueTooMany",
        );
        bad(
            s.clone(),
            json!({"set": ["a", "a"]}),
            "spec.set[1]",
            "FieldValueDuplicate",
        );
        bad(
            s,
            json!({"map": [{"name": "a"}, {"name": "a", "v": 2}]}),
            "spec.map[1]",
            "FieldValueDuplicate",
        );
    }

    #[test]
    fn maps_int_or_string_and_preserved_fields() {
        let s = json!({"type": "object", "properties": {
            "q": {"type": "object", "additionalProperties": {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "pattern": "^[0-9]+[a-zA-Z]*$", "x-kubernetes-int-or-string": true}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}});
        ok(
            s.clone(),
            json!({"q": {"cpu": "100m", "gpu": 2}, "free": {"anything": {"at": ["all"]}}}),
        );
        bad(
            s.clone(),
            json!({"q": {"cpu": true}}),
            "spec.q[cpu]",
            "FieldValueInvalid",
        );
        bad(
            s,
            json!({"q": {"cpu": "lots"}}),
            "spec.q[cpu]",
            "FieldValueInvalid",
        );
    }

    #[test]
    fn nullable_defaults_and_pruning() {
        let s = compile(
            json!({"type": "object", "properties": {"spec": {"type": "object",
            "required": ["mode"],
            "properties": {
                "mode": {"type": "string", "default": "Abort"},
                "n": {"type": "string", "nullable": true},
                "gone": {"type": "string"}}}}}),
        );
        let mut obj = json!({"spec": {"n": null, "gone": null}});
        assert!(s.validate_root(&mut obj).is_empty());
        assert_eq!(obj, json!({"spec": {"mode": "Abort", "n": null}}));
        let mut list = json!({"spec": {"mode": "x", "n": 1}});
        let c = s.validate_root(&mut list);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].field, "spec.n");
    }

    #[test]
    fn unimplemented_keywords_refuse_to_compile() {
        let e = Schema::compile(
            &json!({"type": "object", "x-kubernetes-validations": []}),
            "crd",
        )
        .err()
        .unwrap();
        assert!(e.contains("x-kubernetes-validations"), "{e}");
        assert!(Schema::compile(&json!({"type": "strnig"}), "crd").is_err());
    }
}
