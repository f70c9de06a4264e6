//! The `device` CEL variable: a device's driver, attributes, capacity and
//! `allowMultipleAllocations`, as Kubernetes' `kubernetes.DRADevice` object exposes them.
//!
//! Guarantees:
//! - `device.attributes[domain]` and `device.capacity[domain]` are never errors: a domain the
//!   device has no entry in is an empty map, as in Kubernetes. A missing id inside a domain
//!   map is CEL's "no such key" error, and `has(device.attributes[d].id)` is false.
//! - The CEL value is built at most once per [`DeviceInput`], on first evaluation, and only if
//!   some evaluation misses the result cache.
//! - [`DeviceInput::hash`] is a 128-bit content hash (truncated SHA-256 over a canonical,
//!   order-independent encoding), so it can key a result cache shared across devices without
//!   collisions being constructible.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};

use cel::ExecutionError;
use cel::common::traits::{Container, Indexer, Iterable, Iterator as CelIterator, Sizer};
use cel::common::types::{CelBool, CelInt, CelMap, CelMapKey, CelString, MAP_TYPE, Type};
use cel::common::value::{CowVal, StaticVal, Val};
use cel::context::VariableResolver;
use dramesh_model::{AttrValue, QualifiedName, Quantity};
use sha2::{Digest, Sha256};

use crate::cost::DeviceBounds;
use crate::library::{QuantityVal, SemverVal};

/// One device as the selector sees it. Built once per device by the engine; cheap to keep.
#[derive(Debug)]
pub struct DeviceInput {
    driver: Arc<str>,
    /// Sorted by name; a repeated name keeps its last value, like a Go map built in order.
    attributes: Vec<(QualifiedName, AttrValue)>,
    capacity: Vec<(QualifiedName, Quantity)>,
    allow_multiple_allocations: bool,
    hash: u128,
    bounds: DeviceBounds,
    value: OnceLock<DeviceVal>,
}

fn dedup_last<T>(items: impl IntoIterator<Item = (QualifiedName, T)>) -> Vec<(QualifiedName, T)> {
    // BTreeMap insert overwrites, so the last occurrence of a name wins.
    let map: BTreeMap<QualifiedName, T> = items.into_iter().collect();
    map.into_iter().collect()
}

fn put(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

impl DeviceInput {
    /// Builds the CEL input of one device.
    pub fn new(
        driver: &str,
        attributes: impl IntoIterator<Item = (QualifiedName, AttrValue)>,
        capacity: impl IntoIterator<Item = (QualifiedName, Quantity)>,
        allow_multiple_allocations: bool,
    ) -> DeviceInput {
        let attributes = dedup_last(attributes);
        let capacity = dedup_last(capacity);

        let mut h = Sha256::new();
        put(&mut h, driver.as_bytes());
        h.update([u8::from(allow_multiple_allocations)]);
        h.update((attributes.len() as u64).to_le_bytes());
        for (name, value) in &attributes {
            put(&mut h, name.domain.as_bytes());
            put(&mut h, name.id.as_bytes());
            match value {
                AttrValue::Int(i) => {
                    h.update([0]);
                    h.update(i.to_le_bytes());
                }
                AttrValue::Bool(b) => h.update([1, u8::from(*b)]),
                AttrValue::String(s) => {
                    h.update([2]);
                    put(&mut h, s.as_bytes());
                }
                AttrValue::Version(v) => {
                    h.update([3]);
                    put(&mut h, v.to_string().as_bytes());
                }
            }
        }
        h.update((capacity.len() as u64).to_le_bytes());
        for (name, q) in &capacity {
            put(&mut h, name.domain.as_bytes());
            put(&mut h, name.id.as_bytes());
            h.update(q.nanos().to_le_bytes());
        }
        let digest = h.finalize();
        let mut first = [0u8; 16];
        first.copy_from_slice(&digest[..16]);
        let hash = u128::from_le_bytes(first);

        let bounds = DeviceBounds::of(driver, &attributes, &capacity);
        DeviceInput {
            driver: driver.into(),
            attributes,
            capacity,
            allow_multiple_allocations,
            hash,
            bounds,
            value: OnceLock::new(),
        }
    }

    /// The 128-bit content hash used as the result-cache key.
    pub fn hash(&self) -> u128 {
        self.hash
    }

    /// The device's driver.
    pub fn driver(&self) -> &str {
        &self.driver
    }

    pub(crate) fn bounds(&self) -> &DeviceBounds {
        &self.bounds
    }

    /// The CEL value of `device`, built on first use.
    pub(crate) fn value(&self) -> &DeviceVal {
        self.value.get_or_init(|| self.build())
    }

    fn build(&self) -> DeviceVal {
        let mut attrs: HashMap<Arc<str>, HashMap<CelMapKey<'static>, Box<dyn Val>>> =
            HashMap::new();
        for (name, value) in &self.attributes {
            let v: Box<dyn Val> = match value {
                AttrValue::Int(i) => Box::new(CelInt::from(*i)),
                AttrValue::Bool(b) => Box::new(CelBool::from(*b)),
                AttrValue::String(s) => Box::new(CelString::from(s.to_string())),
                AttrValue::Version(v) => Box::new(SemverVal(Arc::clone(v))),
            };
            attrs
                .entry(Arc::clone(&name.domain))
                .or_default()
                .insert(CelMapKey::from(name.id.to_string()), v);
        }
        let mut caps: HashMap<Arc<str>, HashMap<CelMapKey<'static>, Box<dyn Val>>> = HashMap::new();
        for (name, q) in &self.capacity {
            caps.entry(Arc::clone(&name.domain)).or_default().insert(
                CelMapKey::from(name.id.to_string()),
                Box::new(QuantityVal(*q)),
            );
        }
        DeviceVal(Arc::new(DeviceData {
            driver: CelString::from(self.driver.to_string()),
            attributes: DomainMap::new(attrs),
            capacity: DomainMap::new(caps),
            allow_multiple_allocations: CelBool::from(self.allow_multiple_allocations),
        }))
    }
}

pub(crate) static DEVICE_TYPE: Type = Type::new_unspecified_type("kubernetes.DRADevice");

#[derive(Debug)]
struct DeviceData {
    driver: CelString<'static>,
    attributes: DomainMap,
    capacity: DomainMap,
    allow_multiple_allocations: CelBool,
}

/// The `device` object: fields `driver`, `attributes`, `capacity`, `allowMultipleAllocations`.
#[derive(Debug, Clone)]
pub(crate) struct DeviceVal(Arc<DeviceData>);

impl Val for DeviceVal {
    fn get_type(&self) -> &Type {
        &DEVICE_TYPE
    }
    fn cel_type() -> &'static Type {
        &DEVICE_TYPE
    }
    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other
            .downcast_ref::<DeviceVal>()
            .is_some_and(|o| Arc::ptr_eq(&o.0, &self.0))
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for DeviceVal {}

impl Indexer for DeviceVal {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        let d = &*self.0;
        match idx.downcast_ref::<CelString>().map(|s| s.inner()) {
            Some("driver") => Ok(CowVal::Borrowed(&d.driver)),
            Some("attributes") => Ok(CowVal::Borrowed(&d.attributes)),
            Some("capacity") => Ok(CowVal::Borrowed(&d.capacity)),
            Some("allowMultipleAllocations") => Ok(CowVal::Borrowed(&d.allow_multiple_allocations)),
            Some(other) => Err(ExecutionError::no_such_key(other)),
            None => Err(ExecutionError::UnexpectedType {
                got: idx.get_type().name().to_owned(),
                want: "string".to_owned(),
            }),
        }
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

/// `device.attributes` / `device.capacity`: domain -> (id -> value). Unknown domains are empty
/// maps rather than errors.
#[derive(Debug, Clone)]
pub(crate) struct DomainMap {
    /// Sorted domain names, for deterministic iteration.
    keys: Arc<[CelString<'static>]>,
    domains: Arc<HashMap<Arc<str>, CelMap<'static>>>,
}

static EMPTY: OnceLock<CelMap<'static>> = OnceLock::new();

fn empty_map() -> &'static CelMap<'static> {
    EMPTY.get_or_init(CelMap::default)
}

impl DomainMap {
    fn new(raw: HashMap<Arc<str>, HashMap<CelMapKey<'static>, Box<dyn Val>>>) -> DomainMap {
        let mut names: Vec<Arc<str>> = raw.keys().cloned().collect();
        names.sort();
        let keys: Arc<[CelString<'static>]> = names
            .iter()
            .map(|n| CelString::from(n.to_string()))
            .collect();
        let domains = raw.into_iter().map(|(k, v)| (k, CelMap::from(v))).collect();
        DomainMap {
            keys,
            domains: Arc::new(domains),
        }
    }
}

impl Val for DomainMap {
    fn get_type(&self) -> &Type {
        &MAP_TYPE
    }
    fn cel_type() -> &'static Type {
        &MAP_TYPE
    }
    fn as_container(&self) -> Option<&dyn Container> {
        Some(self)
    }
    fn as_indexer<'b, 'v>(&'b self) -> Option<&'b (dyn Indexer + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn as_iterable<'b, 'v>(&'b self) -> Option<&'b (dyn Iterable + 'v)>
    where
        Self: 'v,
    {
        Some(self)
    }
    fn as_sizer(&self) -> Option<&dyn Sizer> {
        Some(self)
    }
    fn equals(&self, other: &dyn Val) -> bool {
        other.downcast_ref::<DomainMap>().is_some_and(|o| {
            o.domains.len() == self.domains.len()
                && self
                    .domains
                    .iter()
                    .all(|(k, v)| o.domains.get(k).is_some_and(|ov| v.equals(ov)))
        })
    }
    fn clone_as_boxed<'v>(&self) -> Box<dyn Val + 'v> {
        Box::new(self.clone())
    }
    fn as_any(&self) -> Option<&dyn Any> {
        Some(self)
    }
}
impl StaticVal for DomainMap {}

impl Indexer for DomainMap {
    fn get<'b, 'v>(&'b self, idx: &dyn Val) -> Result<CowVal<'b, 'v>, ExecutionError>
    where
        Self: 'v,
    {
        match idx.downcast_ref::<CelString>() {
            Some(s) => Ok(CowVal::Borrowed(
                self.domains.get(s.inner()).unwrap_or_else(|| empty_map()),
            )),
            None => Err(ExecutionError::UnexpectedType {
                got: idx.get_type().name().to_owned(),
                want: "string".to_owned(),
            }),
        }
    }

    fn steal<'v>(self: Box<Self>, idx: &dyn Val) -> Result<Box<dyn Val + 'v>, ExecutionError>
    where
        Self: 'v,
    {
        self.get(idx).map(CowVal::into_owned)
    }
}

impl Container for DomainMap {
    fn contains(&self, value: &dyn Val) -> Result<bool, ExecutionError> {
        Ok(value
            .downcast_ref::<CelString>()
            .is_some_and(|s| self.domains.contains_key(s.inner())))
    }
}

impl Sizer for DomainMap {
    fn size(&self) -> CelInt {
        CelInt::from(i64::try_from(self.domains.len()).unwrap_or(i64::MAX))
    }
}

struct KeyIter<'b>(std::slice::Iter<'b, CelString<'static>>);

impl<'b, 'v> CelIterator<'b, 'v> for KeyIter<'b> {
    fn next(&mut self) -> Option<&'b (dyn Val + 'v)> {
        self.0.next().map(|s| s as &dyn Val)
    }
}

impl Iterable for DomainMap {
    fn iter<'b, 'v>(&'b self) -> Box<dyn CelIterator<'b, 'v> + 'b>
    where
        Self: 'v,
    {
        Box::new(KeyIter(self.keys.iter()))
    }
}

/// Resolves the single variable `device` by borrowing the prebuilt value.
pub(crate) struct DeviceResolver<'a>(pub(crate) &'a DeviceVal);

impl VariableResolver for DeviceResolver<'_> {
    fn resolve<'b>(&'b self, variable: &str) -> Option<CowVal<'b, 'b>> {
        (variable == "device").then(|| CowVal::Borrowed(self.0 as &dyn Val))
    }
}
