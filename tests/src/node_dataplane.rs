//! The iptables dataplane running in a node's network namespace: every call is made
//! from a thread that has joined it, so the tools it runs act on that namespace.

use weir::dataplane::iptables::{IptablesConfig, IptablesDataplane};
use weir::dataplane::{ApplyReport, Dataplane, DataplaneError, DataplaneStatus, Scope};
use weir_policy::desired::Desired;

use crate::pods::run_in;

pub struct NodeDataplane {
    ns: String,
    dataplane: Option<IptablesDataplane>,
}

type Call = Box<dyn FnOnce(&mut IptablesDataplane) -> Result<ApplyReport, DataplaneError> + Send>;

impl NodeDataplane {
    pub fn start(ns: &str, config: IptablesConfig) -> Result<NodeDataplane, DataplaneError> {
        let dataplane = run_in(ns, move || IptablesDataplane::new(config))?;
        Ok(NodeDataplane {
            ns: ns.to_string(),
            dataplane: Some(dataplane),
        })
    }

    fn call(&mut self, f: Call) -> Result<ApplyReport, DataplaneError> {
        let mut dp = self
            .dataplane
            .take()
            .expect("dataplane present between calls");
        let (dp, result) = run_in(&self.ns, move || {
            let r = f(&mut dp);
            (dp, r)
        });
        self.dataplane = Some(dp);
        result
    }

    /// Converges the dataplane on `desired`, as the daemon would.
    pub fn converge(
        &mut self,
        desired: &Desired,
        scope: Scope,
    ) -> Result<ApplyReport, DataplaneError> {
        let d = desired.clone();
        self.call(Box::new(move |dp| dp.converge(&d, scope)))
    }

    /// The dataplane's status (no kernel access: it reports what it last wrote).
    pub fn status(&self) -> DataplaneStatus {
        self.dataplane
            .as_ref()
            .expect("dataplane present between calls")
            .status()
    }
}
