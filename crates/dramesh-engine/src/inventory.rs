//! The per-cluster device inventory in the compact form the allocator searches.
//!
//! Built from ResourceSlices, DeviceClasses and DeviceTaintRules, and updated one object at a
//! time (upsert/remove), so a replication stream can keep it current without rebuilding.
//! Every quantity is parsed once, attribute and capacity names are split into qualified
//! names once, each device carries its ready-made CEL input, and class selectors are compiled
//! once per class. Request selectors are compiled on first use and cached by expression.
//! Devices whose published fields other than the name are identical share one parsed form
//! (and so one CEL input and one built CEL value), which is what keeps a fleet of identical
//! GPUs small.
//!
//! Guarantees: an object that Kubernetes validation would reject for a malformed quantity is
//! refused with an [`InventoryError`] naming the object and field; problems Kubernetes only
//! notices while allocating (an attribute without a value, a CEL compile error in a class)
//! are kept and reported by the allocator when a pod actually touches them.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex};

use dramesh_model::k8s;
use dramesh_model::{AttrValue, QualifiedName, Quantity};

use crate::celx::{self, CelEnv, CelError, DeviceInput, Limits, Selector};

/// An object the inventory refuses, with the object and field that are wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{object}: field {field}: {message}")]
pub struct InventoryError {
    /// `Kind name`.
    pub object: String,
    /// Field path of the offending value.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

fn inv_err(object: &str, field: String, message: impl Into<String>) -> InventoryError {
    InventoryError {
        object: object.to_string(),
        field,
        message: message.into(),
    }
}

fn parse_q(
    q: &k8s::K8sQuantity,
    object: &str,
    field: impl FnOnce() -> String,
) -> Result<Quantity, InventoryError> {
    Quantity::parse(&q.0).map_err(|e| inv_err(object, field(), e.to_string()))
}

/// One device attribute.
#[derive(Debug, Clone)]
pub(crate) struct Attr {
    /// The key exactly as published (`model` or `domain/model`).
    pub raw: String,
    pub qn: QualifiedName,
    /// `None` when the attribute has no (supported) value.
    pub value: Option<AttrValue>,
    /// The version string as published, compared verbatim by `matchAttribute`.
    pub version_raw: Option<String>,
}

/// `capacity.requestPolicy` of a consumable capacity.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Policy {
    pub default: Option<Quantity>,
    pub valid_values: Vec<Quantity>,
    pub range: Option<Range>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Range {
    pub min: Quantity,
    pub max: Option<Quantity>,
    pub step: Option<Quantity>,
}

#[derive(Debug, Clone)]
pub(crate) struct Cap {
    pub raw: String,
    pub qn: QualifiedName,
    pub value: Quantity,
    pub policy: Option<Policy>,
}

#[derive(Debug, Clone)]
pub(crate) struct Consumption {
    pub set: Arc<str>,
    pub counters: Vec<(Arc<str>, Quantity)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Taint {
    pub key: String,
    pub value: String,
    pub effect: String,
}

/// One device: its name plus the parsed content, which is shared by every device of the
/// inventory whose published fields other than the name are identical (the typical fleet has
/// thousands of identical GPUs per model), so the parsed form and its CEL input exist once.
pub(crate) struct Device {
    pub name: Arc<str>,
    pub core: Arc<DeviceCore>,
}

impl std::ops::Deref for Device {
    type Target = DeviceCore;
    fn deref(&self) -> &DeviceCore {
        &self.core
    }
}

/// Everything about a device except its name, derived only from the device's own fields and
/// its slice's driver (so equal sources give equal cores).
pub(crate) struct DeviceCore {
    pub attrs: Vec<Attr>,
    /// Why a CEL input cannot be built for this device (an attribute without a value).
    pub attr_error: Option<String>,
    pub cel_input: Option<DeviceInput>,
    pub capacity: Vec<Cap>,
    pub consumes: Vec<Consumption>,
    pub node_name: Option<String>,
    pub all_nodes: bool,
    pub node_selector: Option<k8s::NodeSelector>,
    pub taints: Vec<Taint>,
    pub binds_to_node: bool,
    pub binding_conditions: Option<Vec<String>>,
    pub binding_failure_conditions: Option<Vec<String>>,
    pub allow_multiple: bool,
}

impl DeviceCore {
    /// `lookupAttribute`: the exact key first, then the bare identifier when the domain is
    /// the driver's.
    pub(crate) fn lookup_attr(&self, full: &str, driver: &str) -> Option<&Attr> {
        if let Some(a) = self.attrs.iter().find(|a| a.raw == full) {
            return Some(a);
        }
        let (domain, id) = full.split_once('/')?;
        if domain != driver {
            return None;
        }
        self.attrs.iter().find(|a| a.raw == id)
    }
}

#[derive(Debug, Clone)]
pub(crate) struct CounterSet {
    pub name: Arc<str>,
    pub counters: Vec<(Arc<str>, Quantity)>,
}

pub(crate) struct Slice {
    pub name: String,
    pub driver: Arc<str>,
    pub pool: Arc<str>,
    pub generation: i64,
    pub slice_count: i64,
    pub node_name: Option<String>,
    pub node_selector: Option<k8s::NodeSelector>,
    pub all_nodes: bool,
    pub per_device_node_selection: Option<bool>,
    pub shared_counters: Vec<CounterSet>,
    pub devices: Vec<Device>,
}

pub(crate) struct Class {
    pub name: String,
    pub selectors: Vec<Result<Selector, CelError>>,
    pub config: Vec<k8s::DeviceClassConfiguration>,
    pub extended_resource_name: Option<String>,
    pub created: Option<String>,
}

pub(crate) struct TaintRule {
    pub driver: Option<String>,
    pub pool: Option<String>,
    pub device: Option<String>,
    pub taint: Taint,
}

impl TaintRule {
    pub(crate) fn selects(&self, driver: &str, pool: &str, device: &str) -> bool {
        self.driver.as_deref().is_none_or(|d| d == driver)
            && self.pool.as_deref().is_none_or(|p| p == pool)
            && self.device.as_deref().is_none_or(|d| d == device)
    }
}

/// Interns [`DeviceCore`]s by content so identical devices share one.
///
/// The key is a 128-bit digest of the JSON encoding of exactly the device fields
/// `parse_device` reads, plus the driver, computed with two independently and randomly keyed
/// SipHash instances: keys are secret per process, so a publisher cannot construct two
/// different devices that collide, and an accidental collision has probability ~2^-128.
/// Entries no device references any more are dropped in amortized batches.
struct CoreInterner {
    keys: (std::hash::RandomState, std::hash::RandomState),
    map: HashMap<(u64, u64), Arc<DeviceCore>>,
    prune_at: usize,
}

/// Minimum interner size before unreferenced entries are swept.
const CORE_PRUNE_MIN: usize = 1024;

impl CoreInterner {
    fn new() -> CoreInterner {
        CoreInterner {
            keys: (std::hash::RandomState::new(), std::hash::RandomState::new()),
            map: HashMap::new(),
            prune_at: CORE_PRUNE_MIN,
        }
    }

    fn key(&self, d: &k8s::Device, driver: &str) -> (u64, u64) {
        use std::hash::{BuildHasher, Hasher};
        struct Both<A, B>(A, B);
        impl<A: Hasher, B: Hasher> std::io::Write for Both<A, B> {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.write(buf);
                self.1.write(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut w = Both(self.keys.0.build_hasher(), self.keys.1.build_hasher());
        // Every field of the device except its name; keep in sync with `parse_device`.
        let fields = (
            driver,
            &d.attributes,
            &d.capacity,
            &d.consumes_counters,
            &d.node_name,
            &d.all_nodes,
            &d.node_selector,
            &d.taints,
            &d.binds_to_node,
            &d.binding_conditions,
            &d.binding_failure_conditions,
            &d.allow_multiple_allocations,
        );
        // Serializing plain data into a writer that never fails does not fail; should it
        // ever, the sentinel key makes the caller parse the device without sharing it.
        if serde_json::to_writer(&mut w, &fields).is_err() {
            return (u64::MAX, u64::MAX);
        }
        (w.0.finish(), w.1.finish())
    }

    fn get_or_parse(
        &mut self,
        d: &k8s::Device,
        di: usize,
        driver: &str,
        object: &str,
    ) -> Result<Arc<DeviceCore>, InventoryError> {
        let key = self.key(d, driver);
        if key == (u64::MAX, u64::MAX) {
            return Ok(Arc::new(parse_device(d, di, driver, object)?));
        }
        if let Some(c) = self.map.get(&key) {
            return Ok(c.clone());
        }
        let core = Arc::new(parse_device(d, di, driver, object)?);
        if self.map.len() >= self.prune_at {
            self.map.retain(|_, c| Arc::strong_count(c) > 1);
            self.prune_at = (self.map.len() * 2).max(CORE_PRUNE_MIN);
        }
        self.map.insert(key, core.clone());
        Ok(core)
    }
}

/// A small sorted set of slice names. Most nodes and pools have one or two slices, where a
/// `BTreeSet` would allocate a whole eleven-slot node per set.
pub(crate) type NameSet = Vec<String>;

fn set_insert(set: &mut NameSet, name: &str) {
    if let Err(i) = set.binary_search_by(|x| x.as_str().cmp(name)) {
        set.insert(i, name.to_string());
    }
}

fn set_remove(set: &mut NameSet, name: &str) {
    if let Ok(i) = set.binary_search_by(|x| x.as_str().cmp(name)) {
        set.remove(i);
    }
}

/// Pool identity: (driver, pool name).
pub(crate) type PoolKey = (Arc<str>, Arc<str>);

/// Devices, classes and taint rules of one cluster, indexed for allocation.
pub struct Inventory {
    /// Shared with the inventories [`Inventory::node_copy`] makes, so their classes' compiled
    /// selectors stay valid and their CEL caches are warm.
    cel: Arc<CelEnv>,
    pub(crate) slices: BTreeMap<String, Arc<Slice>>,
    /// Slice names with `spec.nodeName`, per node (sorted; see [`NameSet`]).
    pub(crate) by_node: HashMap<String, NameSet>,
    /// Slice names without `spec.nodeName` (network-attached, all-nodes, per-device, counters).
    pub(crate) nodeless: BTreeSet<String>,
    /// All slice names of each pool, any node, any generation.
    pub(crate) pools: BTreeMap<PoolKey, NameSet>,
    pub(crate) classes: BTreeMap<String, Arc<Class>>,
    pub(crate) taint_rules: BTreeMap<String, Arc<TaintRule>>,
    compiled: Mutex<HashMap<String, Result<Selector, CelError>>>,
    cores: CoreInterner,
}

impl Default for Inventory {
    fn default() -> Self {
        Inventory::new()
    }
}

impl fmt::Debug for Inventory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inventory")
            .field("slices", &self.slices.len())
            .field("classes", &self.classes.len())
            .field("taint_rules", &self.taint_rules.len())
            .finish()
    }
}

/// Upper bound of cached request-selector compilations; the cache is cleared when full so a
/// stream of distinct expressions cannot grow memory without bound.
const MAX_COMPILED: usize = 4096;

impl Inventory {
    /// An empty inventory with Kubernetes' CEL limits.
    pub fn new() -> Inventory {
        Inventory::with_cel_limits(Limits::default())
    }

    /// An empty inventory whose CEL environment uses these limits.
    pub fn with_cel_limits(limits: Limits) -> Inventory {
        Inventory {
            cel: Arc::new(CelEnv::new(limits)),
            slices: BTreeMap::new(),
            by_node: HashMap::new(),
            nodeless: BTreeSet::new(),
            pools: BTreeMap::new(),
            classes: BTreeMap::new(),
            taint_rules: BTreeMap::new(),
            compiled: Mutex::new(HashMap::new()),
            cores: CoreInterner::new(),
        }
    }

    /// Builds an inventory from complete object lists.
    pub fn from_objects<'a>(
        slices: impl IntoIterator<Item = &'a k8s::ResourceSlice>,
        classes: impl IntoIterator<Item = &'a k8s::DeviceClass>,
        taint_rules: impl IntoIterator<Item = &'a k8s::DeviceTaintRule>,
    ) -> Result<Inventory, InventoryError> {
        let mut inv = Inventory::new();
        for s in slices {
            inv.upsert_slice(s)?;
        }
        for c in classes {
            inv.upsert_class(c)?;
        }
        for r in taint_rules {
            inv.upsert_taint_rule(r)?;
        }
        Ok(inv)
    }

    /// An inventory of what a new node shaped like `node` would see: `node`'s local slices
    /// (shared, not re-parsed), every DeviceClass and DeviceTaintRule of this inventory, no
    /// node-less slice, and this inventory's CEL environment (so selectors compiled for the
    /// classes are the same programs). Nothing is allocated in it.
    pub fn node_copy(&self, node: &str) -> Inventory {
        let mut out = Inventory {
            cel: self.cel.clone(),
            slices: BTreeMap::new(),
            by_node: HashMap::new(),
            nodeless: BTreeSet::new(),
            pools: BTreeMap::new(),
            classes: self.classes.clone(),
            taint_rules: self.taint_rules.clone(),
            compiled: Mutex::new(HashMap::new()),
            cores: CoreInterner::new(),
        };
        for name in self.by_node.get(node).into_iter().flatten() {
            let Some(slice) = self.slices.get(name) else {
                continue;
            };
            set_insert(out.by_node.entry(node.to_string()).or_default(), name);
            set_insert(
                out.pools
                    .entry((slice.driver.clone(), slice.pool.clone()))
                    .or_default(),
                name,
            );
            out.slices.insert(name.clone(), slice.clone());
        }
        out
    }

    pub(crate) fn cel(&self) -> &CelEnv {
        &self.cel
    }

    /// Number of slices held.
    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// Number of device classes held.
    pub fn class_count(&self) -> usize {
        self.classes.len()
    }

    /// True when a class with this name is known.
    pub fn has_class(&self, name: &str) -> bool {
        self.classes.contains_key(name)
    }

    /// Compiles (or fetches) a request selector.
    pub(crate) fn compile_cached(&self, expr: &str) -> Result<Selector, CelError> {
        // A poisoned lock only means another thread panicked mid-insert; the map is still
        // a valid cache.
        let mut map = self
            .compiled
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(r) = map.get(expr) {
            return r.clone();
        }
        let r = celx::compile(&self.cel, expr);
        if map.len() >= MAX_COMPILED {
            map.clear();
        }
        map.insert(expr.to_string(), r.clone());
        r
    }

    /// Adds or replaces a ResourceSlice (keyed by name).
    pub fn upsert_slice(&mut self, slice: &k8s::ResourceSlice) -> Result<(), InventoryError> {
        let parsed = parse_slice(slice, &mut self.cores)?;
        let name = parsed.name.clone();
        self.remove_slice(&name);
        match &parsed.node_name {
            Some(n) if !n.is_empty() => {
                set_insert(self.by_node.entry(n.clone()).or_default(), &name);
            }
            _ => {
                self.nodeless.insert(name.clone());
            }
        }
        set_insert(
            self.pools
                .entry((parsed.driver.clone(), parsed.pool.clone()))
                .or_default(),
            &name,
        );
        self.slices.insert(name, Arc::new(parsed));
        Ok(())
    }

    /// Removes a ResourceSlice by name; returns whether it was present.
    pub fn remove_slice(&mut self, name: &str) -> bool {
        let Some(old) = self.slices.remove(name) else {
            return false;
        };
        match &old.node_name {
            Some(n) if !n.is_empty() => {
                if let Some(set) = self.by_node.get_mut(n) {
                    set_remove(set, name);
                    if set.is_empty() {
                        self.by_node.remove(n);
                    }
                }
            }
            _ => {
                self.nodeless.remove(name);
            }
        }
        let key = (old.driver.clone(), old.pool.clone());
        if let Some(set) = self.pools.get_mut(&key) {
            set_remove(set, name);
            if set.is_empty() {
                self.pools.remove(&key);
            }
        }
        true
    }

    /// Adds or replaces a DeviceClass. Selector compile errors are kept and reported when a
    /// request uses the class (Kubernetes fails such pods, it does not reject the class here).
    pub fn upsert_class(&mut self, class: &k8s::DeviceClass) -> Result<(), InventoryError> {
        let name = class.metadata.name.clone().unwrap_or_default();
        let object = format!("DeviceClass {name}");
        if name.is_empty() {
            return Err(inv_err(&object, "metadata.name".into(), "must be set"));
        }
        let selectors = class
            .spec
            .selectors
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|s| match &s.cel {
                Some(c) => self.compile_cached(&c.expression),
                None => Err(CelError::NotCel),
            })
            .collect();
        let entry = Class {
            name: name.clone(),
            selectors,
            config: class.spec.config.clone().unwrap_or_default(),
            extended_resource_name: class.spec.extended_resource_name.clone(),
            created: class
                .metadata
                .creation_timestamp
                .as_ref()
                .and_then(|t| serde_json::to_value(t).ok())
                .and_then(|v| v.as_str().map(str::to_string)),
        };
        self.classes.insert(name, Arc::new(entry));
        Ok(())
    }

    /// Removes a DeviceClass; false when it was not present.
    pub fn remove_class(&mut self, name: &str) -> bool {
        self.classes.remove(name).is_some()
    }

    /// Adds or replaces a DeviceTaintRule; its taint applies to every selected device.
    pub fn upsert_taint_rule(&mut self, rule: &k8s::DeviceTaintRule) -> Result<(), InventoryError> {
        let name = rule.metadata.name.clone().unwrap_or_default();
        if name.is_empty() {
            return Err(inv_err(
                "DeviceTaintRule",
                "metadata.name".into(),
                "must be set",
            ));
        }
        let sel = rule.spec.device_selector.clone().unwrap_or_default();
        let t = &rule.spec.taint;
        let entry = TaintRule {
            driver: sel.driver,
            pool: sel.pool,
            device: sel.device,
            taint: Taint {
                key: t.key.clone(),
                value: t.value.clone().unwrap_or_default(),
                effect: t.effect.clone(),
            },
        };
        self.taint_rules.insert(name, Arc::new(entry));
        Ok(())
    }

    /// Removes a DeviceTaintRule; false when it was not present.
    pub fn remove_taint_rule(&mut self, name: &str) -> bool {
        self.taint_rules.remove(name).is_some()
    }

    /// Names of the held DeviceClasses, sorted.
    pub fn class_names(&self) -> impl Iterator<Item = &str> {
        self.classes.keys().map(String::as_str)
    }

    /// `(driver, pool, device)` of every device of every held slice that the class selects:
    /// each of the class's selectors is true on the device. A selector that does not compile,
    /// a device without a CEL input and a selector that fails on the device select nothing
    /// (the allocator would not pick such a device). Empty for an unknown class. Evaluations
    /// use the inventory's CEL result cache, so repeated calls cost one lookup per device.
    pub fn class_devices<'a>(
        &'a self,
        class: &str,
    ) -> impl Iterator<Item = (&'a str, &'a str, &'a str)> + 'a {
        let class = self.classes.get(class);
        class.into_iter().flat_map(move |c| {
            self.slices.values().flat_map(move |s| {
                s.devices
                    .iter()
                    .filter(move |d| self.class_selects(c, d))
                    .map(move |d| (&*s.driver, &*s.pool, &*d.name))
            })
        })
    }

    fn class_selects(&self, class: &Class, device: &Device) -> bool {
        class
            .selectors
            .iter()
            .all(|sel| match (sel, &device.cel_input) {
                (Ok(sel), Some(input)) => celx::evaluate(&self.cel, sel, input) == Ok(true),
                _ => false,
            })
    }

    /// The DeviceClass that backs an extended resource name (DRAExtendedResource): a class
    /// whose `extendedResourceName` equals it (the most recently created wins, ties go to the
    /// lexicographically first name), else the implicit
    /// `deviceclass.resource.kubernetes.io/<class>` name.
    pub fn extended_resource_class(&self, resource: &str) -> Option<&str> {
        let mut best: Option<&Class> = None;
        for c in self.classes.values() {
            if c.extended_resource_name.as_deref() != Some(resource) {
                continue;
            }
            // RFC 3339 timestamps in UTC compare correctly as strings.
            best = match best {
                Some(b) if b.created >= c.created => Some(b),
                _ => Some(c),
            };
        }
        if let Some(b) = best {
            return Some(&b.name);
        }
        let class = resource.strip_prefix("deviceclass.resource.kubernetes.io/")?;
        self.classes.get(class).map(|c| c.name.as_str())
    }
}

fn parse_slice(s: &k8s::ResourceSlice, cores: &mut CoreInterner) -> Result<Slice, InventoryError> {
    let name = s.metadata.name.clone().unwrap_or_default();
    let object = format!("ResourceSlice {name}");
    if name.is_empty() {
        return Err(inv_err(&object, "metadata.name".into(), "must be set"));
    }
    let spec = &s.spec;
    let driver: Arc<str> = spec.driver.as_str().into();
    let mut shared_counters = Vec::new();
    for (i, cs) in spec.shared_counters.iter().flatten().enumerate() {
        let mut counters = Vec::new();
        for (cn, c) in &cs.counters {
            counters.push((
                Arc::<str>::from(cn.as_str()),
                parse_q(&c.value, &object, || {
                    format!("spec.sharedCounters[{i}].counters[{cn}].value")
                })?,
            ));
        }
        shared_counters.push(CounterSet {
            name: cs.name.as_str().into(),
            counters,
        });
    }
    let mut devices = Vec::new();
    for (di, d) in spec.devices.iter().flatten().enumerate() {
        devices.push(Device {
            name: d.name.as_str().into(),
            core: cores.get_or_parse(d, di, &driver, &object)?,
        });
    }
    Ok(Slice {
        name,
        driver,
        pool: spec.pool.name.as_str().into(),
        generation: spec.pool.generation,
        slice_count: spec.pool.resource_slice_count,
        node_name: spec.node_name.clone().filter(|n| !n.is_empty()),
        node_selector: spec.node_selector.clone(),
        all_nodes: spec.all_nodes.unwrap_or(false),
        per_device_node_selection: spec.per_device_node_selection,
        shared_counters,
        devices,
    })
}

fn parse_device(
    d: &k8s::Device,
    di: usize,
    driver: &str,
    object: &str,
) -> Result<DeviceCore, InventoryError> {
    let mut attrs = Vec::new();
    let mut attr_error = None;
    for (key, a) in d.attributes.iter().flatten() {
        let qn = QualifiedName::parse(key, driver);
        let value = match AttrValue::from_k8s(a) {
            Ok(v) => Some(v),
            Err(e) => {
                attr_error.get_or_insert_with(|| {
                    format!("unsupported attribute value for attribute {key}: {e}")
                });
                None
            }
        };
        attrs.push(Attr {
            raw: key.clone(),
            qn,
            value,
            version_raw: a.version.clone(),
        });
    }
    let mut capacity = Vec::new();
    for (key, c) in d.capacity.iter().flatten() {
        let field = |f: &str| format!("spec.devices[{di}].capacity[{key}].{f}");
        let value = parse_q(&c.value, object, || field("value"))?;
        let policy = match &c.request_policy {
            None => None,
            Some(p) => {
                let default = match &p.default {
                    Some(q) => Some(parse_q(q, object, || field("requestPolicy.default"))?),
                    None => None,
                };
                let mut valid_values = Vec::new();
                for (i, q) in p.valid_values.iter().flatten().enumerate() {
                    valid_values.push(parse_q(q, object, || {
                        field(&format!("requestPolicy.validValues[{i}]"))
                    })?);
                }
                let range = match &p.valid_range {
                    None => None,
                    Some(r) => Some(Range {
                        min: parse_q(&r.min, object, || field("requestPolicy.validRange.min"))?,
                        max: match &r.max {
                            Some(q) => Some(parse_q(q, object, || {
                                field("requestPolicy.validRange.max")
                            })?),
                            None => None,
                        },
                        step: match &r.step {
                            Some(q) => Some(parse_q(q, object, || {
                                field("requestPolicy.validRange.step")
                            })?),
                            None => None,
                        },
                    }),
                };
                if range
                    .as_ref()
                    .and_then(|r| r.step)
                    .is_some_and(|s| s.nanos() <= 0)
                {
                    return Err(inv_err(
                        object,
                        field("requestPolicy.validRange.step"),
                        "must be positive",
                    ));
                }
                Some(Policy {
                    default,
                    valid_values,
                    range,
                })
            }
        };
        capacity.push(Cap {
            raw: key.clone(),
            qn: QualifiedName::parse(key, driver),
            value,
            policy,
        });
    }
    let mut consumes = Vec::new();
    for (ci, c) in d.consumes_counters.iter().flatten().enumerate() {
        let mut counters = Vec::new();
        for (cn, v) in &c.counters {
            counters.push((
                Arc::<str>::from(cn.as_str()),
                parse_q(&v.value, object, || {
                    format!("spec.devices[{di}].consumesCounters[{ci}].counters[{cn}].value")
                })?,
            ));
        }
        consumes.push(Consumption {
            set: c.counter_set.as_str().into(),
            counters,
        });
    }
    let allow_multiple = d.allow_multiple_allocations.unwrap_or(false);
    let cel_input = if attr_error.is_none() {
        Some(celx::device_input(
            driver,
            attrs
                .iter()
                .filter_map(|a| a.value.clone().map(|v| (a.qn.clone(), v)))
                .collect(),
            capacity.iter().map(|c| (c.qn.clone(), c.value)).collect(),
            allow_multiple,
        ))
    } else {
        None
    };
    Ok(DeviceCore {
        attrs,
        attr_error,
        cel_input,
        capacity,
        consumes,
        node_name: d.node_name.clone().filter(|n| !n.is_empty()),
        all_nodes: d.all_nodes.unwrap_or(false),
        node_selector: d.node_selector.clone(),
        taints: d
            .taints
            .iter()
            .flatten()
            .map(|t| Taint {
                key: t.key.clone(),
                value: t.value.clone().unwrap_or_default(),
                effect: t.effect.clone(),
            })
            .collect(),
        binds_to_node: d.binds_to_node.unwrap_or(false),
        binding_conditions: d.binding_conditions.clone().filter(|v| !v.is_empty()),
        binding_failure_conditions: d
            .binding_failure_conditions
            .clone()
            .filter(|v| !v.is_empty()),
        allow_multiple,
    })
}
